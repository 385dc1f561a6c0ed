"""`update`: the next loss-scale state: the kind's rule and the library's counters."""

from __future__ import annotations

from typing import cast

import jax
import jax.numpy as jnp
import optax

from lossscale._src import validation
from lossscale._src.state.kind import LossScale
from lossscale._src.state.kind import LossScaleT
from lossscale._src.state.kind import rule_fields


def update(
    loss_scale: LossScaleT,
    grads_finite: jax.typing.ArrayLike,
    loss_finite: jax.typing.ArrayLike = True,
) -> LossScaleT:
    """Returns the next loss-scale state after a step.

    Usable inside `jax.jit`; branch-free. The kind's `rule` (for a
    `DynamicLossScale` the growth/back-off rule) sees the steps whose loss was
    finite; every kind counts the skipped steps. The step is applied when both
    `grads_finite` and `loss_finite` hold; the caller must skip it otherwise.

    Args:
      loss_scale: the current loss-scale state.
      grads_finite: boolean scalar, whether every gradient of the step was finite
        (see `lossscale.all_finite`).
      loss_finite: boolean scalar, whether the (unscaled) loss was finite. A
        non-finite loss is an overflow in the forward pass: lowering the scale
        cannot fix it, so the rule does not see the step (the scale does not back
        off), and the step is counted in `forward_overflows`.

    Returns:
      The next loss-scale state, with the same settings and tree structure.

    Raises:
      TypeError: if `loss_scale` is not a loss-scale state (an optimizer state:
        use `get_loss_scale`), `grads_finite` or `loss_finite` is not boolean
        (the gradients or the loss themselves: the message says how to reduce
        them), or the kind's `rule` returns something other than a state of
        the same kind, settings and leaf types.
      ValueError: if `grads_finite` or `loss_finite` is not a scalar.

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale
      >>> loss_scale = lossscale.DynamicLossScale(scale=2.0**15)
      >>> loss_scale = lossscale.update(loss_scale, jnp.array(False))
      >>> print(loss_scale.scale, loss_scale.skipped_steps)
      16384.0 1
    """
    if not isinstance(loss_scale, LossScale):
        raise TypeError(
            "`loss_scale` must be a loss-scale state (a `lossscale.LossScale`, e.g."
            f" `DynamicLossScale`), got {type(loss_scale).__name__}. To read one out"
            " of an optimizer state, use `lossscale.get_loss_scale(opt_state)`."
            " `lossscale.update(loss_scale, grads_finite)` moves a loss-scale state"
            " after a step; the optimizer's step itself is `tx.update(grads,"
            " opt_state, params)` of `lossscale.wrap(tx)`, or"
            " `lossscale.apply_gradients(tx, grads=..., params=..., ...)`."
        )
    grads_finite = validation.as_predicate(
        "grads_finite", grads_finite, "lossscale.all_finite(grads)"
    )
    loss_finite = validation.as_predicate(
        "loss_finite", loss_finite, "jnp.isfinite(loss)"
    )
    # Of `loss_scale`'s kind: `next_state` refuses a rule that returns another.
    return cast(LossScaleT, next_state(loss_scale, grads_finite, loss_finite))


def next_state(
    loss_scale: LossScale,
    grads_finite: jax.Array,
    loss_finite: jax.Array,
    first_nonfinite: jax.Array | None = None,
) -> LossScale:
    """`update` of validated flags; the guarded step's also records `overflow_leaf`.

    A skipped step records the scale it ran at, as `overflow_scale` (what
    `locate_overflow` reruns its batch at), and `first_nonfinite`, the first
    non-finite leaf's index (`finite.Checked.first`), as `overflow_leaf`; an
    applied one keeps the last.
    """
    ruled = _ruled(loss_scale, grads_finite)
    applied = grads_finite & loss_finite
    backward_overflow = loss_finite & ~grads_finite
    # A forward overflow keeps the rule's fields: the scale did not cause it.
    kept_on_forward_overflow = {
        name: jnp.where(loss_finite, getattr(ruled, name), getattr(loss_scale, name))
        for name in rule_fields(type(loss_scale))
    }
    counters = dict(
        skipped_steps=_counted(loss_scale.skipped_steps, applied),
        consecutive_skips=_counted(
            loss_scale.consecutive_skips, applied, jnp.zeros([], jnp.int32)
        ),
        forward_overflows=_counted(loss_scale.forward_overflows, loss_finite),
        # `~(scale > min_scale)`, not `scale <= min_scale`: a NaN scale is stuck too.
        stuck=backward_overflow & ~(loss_scale.scale > loss_scale.min_scale),
        overflow_scale=jnp.where(
            applied,
            loss_scale.overflow_scale,
            jnp.asarray(loss_scale.scale, jnp.float32),
        ),
    )
    if first_nonfinite is not None:
        counters["overflow_leaf"] = jnp.where(
            applied, loss_scale.overflow_leaf, first_nonfinite
        )
    return _in_one_kernel(loss_scale.replace(**kept_on_forward_overflow, **counters))


def was_applied(loss_scale: LossScale) -> jax.Array:
    """Whether the step that gave `loss_scale` was applied: no skip is pending.

    `update` sets `consecutive_skips` to 0 exactly on an applied step.
    """
    # `jnp.asarray` unwraps containers such as the variables of `nnx.Optimizer`.
    return jnp.asarray(loss_scale.consecutive_skips) == jnp.zeros([], jnp.int32)


def _counted(
    count: jax.Array, unless: jax.Array, reset: jax.Array | None = None
) -> jax.Array:
    """`count` plus one (saturating); where `unless` holds, `reset` or `count` as is."""
    kept = count if reset is None else reset
    return jnp.where(unless, kept, optax.safe_increment(count))


def _ruled(loss_scale: LossScale, grads_finite: jax.Array) -> LossScale:
    """The kind's `rule`, checked to return a state of the same type and layout."""
    ruled = loss_scale.rule(grads_finite)
    kind = type(loss_scale).__name__
    if type(ruled) is not type(loss_scale):
        raise TypeError(
            f"`{kind}.rule` must return a `{kind}` (e.g. `self.replace(...)`), got"
            f" {type(ruled).__name__}."
        )
    if jax.tree.structure(ruled) != jax.tree.structure(loss_scale):
        raise TypeError(
            f"`{kind}.rule` returned a state with other settings; it must keep"
            " them (return `self.replace(...)`)."
        )
    for name in rule_fields(type(loss_scale)):
        old, new = getattr(loss_scale, name), getattr(ruled, name)
        if (jnp.shape(new), jnp.result_type(new)) != (jnp.shape(old), old.dtype):
            raise TypeError(
                f"`{kind}.rule` changed field `{name}` from {old.dtype}"
                f"{list(jnp.shape(old))} to {jnp.result_type(new)}"
                f"{list(jnp.shape(new))}; a rule must keep each field's dtype and"
                " shape (the state is compiled into the step)."
            )
    return ruled


def _in_one_kernel(state: LossScale) -> LossScale:
    """`state`, its scalars computed in one kernel on XLA:CPU; elsewhere as it is.

    XLA:CPU compiles a kernel for each value a program gives: about 10 ms of
    compile each, for a state's dozen scalars. A variadic reduce of each scalar
    beside its sum's or its `or`'s identity (`x + (-0.0)` is `x`, bit for bit) gives
    them all from one. Not inside `shard_map`, where the reduce would make every
    scalar vary over the axes any one varies over.
    """
    if getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()):
        return state

    def one_kernel(state):
        leaves, treedef = jax.tree.flatten(state)
        picked = [i for i, x in enumerate(leaves) if jnp.ndim(x) == 0]
        picked = [i for i in picked if _identity(leaves[i].dtype) is not None]
        if not picked:
            return state
        units = [
            jnp.asarray(_identity(leaves[i].dtype), leaves[i].dtype) for i in picked
        ]
        pairs = [jnp.stack([leaves[i], u]) for i, u in zip(picked, units, strict=True)]
        reduced = jax.lax.reduce(tuple(pairs), tuple(units), _or_add, (0,))
        for i, x in zip(picked, reduced, strict=True):
            leaves[i] = x
        return jax.tree.unflatten(treedef, leaves)

    def as_it_is(state):
        return state

    return jax.lax.platform_dependent(
        state, default=one_kernel, cuda=as_it_is, rocm=as_it_is, tpu=as_it_is
    )


def _identity(dtype: jnp.dtype) -> bool | int | float | None:
    """The identity of `_or_add` for `dtype`, or None for a dtype it does not take."""
    if dtype == jnp.bool_:
        return False
    if jnp.issubdtype(dtype, jnp.integer):
        return 0
    return -0.0 if jnp.issubdtype(dtype, jnp.floating) else None


def _or_add(a: tuple, b: tuple) -> tuple:
    return tuple(
        x | y if x.dtype == jnp.bool_ else x + y for x, y in zip(a, b, strict=True)
    )
