"""The guarded step: check the gradients, then apply or skip the step.

`wrap`, `apply_gradients`, `lossscale.flax.TrainState` and
`lossscale.flax.Optimizer` (through `wrap`) all run `guarded_step`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.extend
import jax.numpy as jnp

from lossscale._src import checks
from lossscale._src import numerics
from lossscale._src.kind import LossScale
from lossscale._src.update import update


class StepOptions(NamedTuple):
    """The settings of a guarded step, validated once where the step is built."""

    axis_name: checks.AxisName | None
    clip_norm: float | None


def step_options(axis_name: Any, clip_norm: Any) -> StepOptions:
    """Validates `axis_name` and `clip_norm`; raises naming the bad one."""
    return StepOptions(
        checks.validate_axis_name(axis_name), checks.validate_clip_norm(clip_norm)
    )


def guarded_step(
    loss_scale: LossScale,
    grads: Any,
    params: Any,
    value: Any,
    options: StepOptions,
    applied_step: Callable[[Any, Any], tuple[Any, Any]],
    carry: Any,
) -> tuple[Any, Any, LossScale, jax.Array]:
    """One loss-scaled step.

    1. Checks, in one pass over `grads`, whether the unscaled gradients are all
       finite and which leaf is first not to be (with `clip_norm`, their global
       norm is the check), and whether the loss `value` is (when given); agrees
       on all three over `axis_name`, in one collective.
    2. Either `applied_step(unscaled_grads, carry)`, returning `(output,
       new_carry)`, where the unscaling (and clipping) fuses into the step; or the
       skip: negative zeros shaped like `output` (`p + (-0.0)` is `p` bit for bit)
       and `carry` untouched. On XLA:CPU a `jax.lax.cond` chooses, so a skipped
       step costs nothing; elsewhere a select, which XLA:GPU and the TPU compiler
       fuse into the step's own pass (design.md, "A cond on the CPU, a select
       elsewhere"). Flax's fp8 collection is split off by the caller
       (`fp8.split`) before: it takes no part in the check or the unscaling.
    3. Updates the loss-scale state: the unscaling used the scale the loss was
       multiplied by, the next step uses the new one.

    Args:
      loss_scale: the current loss-scale state.
      grads: the gradients of the scaled loss, checked here.
      params: the parameters (their dtypes decide the unscaled dtypes), or None.
      value: the unscaled loss, or None.
      options: `axis_name` and `clip_norm`, checked where the step was built.
      applied_step: the step on the unscaled gradients.
      carry: what a skipped step returns as it is (the optimizer state).

    Returns:
      `(output, carry, loss_scale, applied)`.
    """
    checks.validate_gradients(grads, params)
    checks.refuse_unbound_axis(
        options.axis_name, "the step (`wrap`'s `update`, `apply_gradients`, ...)"
    )
    checked = numerics.check(
        grads, loss_scale, params, norm=options.clip_norm is not None
    )
    if value is None:
        loss_finite = jnp.asarray(True)
    else:
        loss_finite = jnp.isfinite(checks.validate_loss(value, "value"))
    grads_finite, loss_finite, first = agree_with_index(
        checked.finite, loss_finite, checked.first, options.axis_name
    )
    applied = grads_finite & loss_finite

    def apply(grads, carry):
        grads = numerics.unscale(grads, loss_scale, params)
        if options.clip_norm is not None:
            grads = numerics.clip_to_norm(grads, checked.norm, options.clip_norm)
        return applied_step(grads, carry)

    # Traced once, whichever backend's form is lowered (design.md, "The step").
    step = _traced_once(apply, grads, carry)
    select = functools.partial(_select, applied, step)
    output, carry = numerics.per_backend(
        grads,
        carry,
        cpu=functools.partial(_cond, applied, step),
        gpu=select,
        tpu=select,
    )
    loss_scale = update(loss_scale, grads_finite, loss_finite)
    overflow_leaf = jnp.where(applied, loss_scale.overflow_leaf, first)
    return output, carry, loss_scale.replace(overflow_leaf=overflow_leaf), applied


class _Traced(NamedTuple):
    """A step traced once to a jaxpr: `run` evaluates it, `types` its outputs."""

    run: Callable[[Any, Any], Any]
    types: Any


def _traced_once(apply: Callable, grads: Any, carry: Any) -> _Traced:
    """`apply` traced once: both forms of the step then evaluate its jaxpr.

    `lax.platform_dependent` traces every backend's form; tracing the inner update
    once (optax's Python) and evaluating its jaxpr in each costs less than tracing
    it in each.
    """
    closed, shapes = jax.make_jaxpr(apply, return_shape=True)(grads, carry)
    evaluate = jax.extend.core.jaxpr_as_fun(closed)
    out_tree = jax.tree.structure(shapes)
    # From the abstract values, which keep the `shard_map` typing (which mapped
    # axes the values vary over) that the skip's zeros must have too.
    types = out_tree.unflatten(
        [jax.ShapeDtypeStruct.like(aval) for aval in closed.out_avals]
    )

    def run(grads, carry):
        return out_tree.unflatten(evaluate(*jax.tree.leaves((grads, carry))))

    return _Traced(run, types)


def _cond(applied: jax.Array, step: _Traced, grads: Any, carry: Any) -> Any:
    """The step under `jax.lax.cond`: a skipped step does none of its work."""
    return jax.lax.cond(
        applied,
        lambda operands: step.run(*operands),
        lambda operands: _skipped(step.types, operands[1]),
        (grads, carry),
    )


def _select(applied: jax.Array, step: _Traced, grads: Any, carry: Any) -> Any:
    """The step, then a select between its result and the skip's, leaf by leaf."""
    result = step.run(grads, carry)
    skipped = _skipped(step.types, carry)
    return jax.tree.map(lambda a, b: jnp.where(applied, a, b), result, skipped)


def _skipped(types: Any, carry: Any) -> Any:
    """What a skipped step returns: negative zeros for the output, `carry` as is.

    The step may change dtypes (float16 gradients, float32 updates), which is
    where `optax.apply_if_finite` fails: the zeros take the applied types.
    """
    output_types, carry_types = types
    checks.refuse_changed_types(carry_types, carry)
    zeros = jax.tree.map(lambda t: jnp.full_like(t, -0.0), output_types)
    return zeros, carry


def agree(flags: jax.Array, axis_name: checks.AxisName | None) -> jax.Array:
    """Boolean flags, True only where they hold on every device of `axis_name`.

    Several flags go in one array, so they cost one scalar collective together.
    """
    if axis_name is None:
        return flags
    return jax.lax.pmin(flags.astype(jnp.int32), axis_name) == 1


def agree_with_index(
    grads_finite: jax.Array,
    loss_finite: jax.Array,
    first: jax.Array,
    axis_name: checks.AxisName | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The flags agreed over `axis_name`, and the smallest leaf index (-1: none).

    All three in one scalar collective.
    """
    if axis_name is None:
        return grads_finite, loss_finite, first
    none = jnp.iinfo(jnp.int32).max
    values = jnp.stack(
        [
            grads_finite.astype(jnp.int32),
            loss_finite.astype(jnp.int32),
            jnp.where(first < 0, jnp.int32(none), first),
        ]
    )
    grads_finite, loss_finite, first = jax.lax.pmin(values, axis_name)
    return grads_finite == 1, loss_finite == 1, jnp.where(first == none, -1, first)
