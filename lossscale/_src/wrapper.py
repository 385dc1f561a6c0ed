"""The optax wrapper: unscale, check, skip non-finite steps, update the scale."""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from lossscale._src import checks
from lossscale._src import fp8
from lossscale._src import kinds
from lossscale._src import lookup
from lossscale._src import step
from lossscale._src.base import LossScale


class WrapState(NamedTuple):
    """State of the `optax.GradientTransformationExtraArgs` returned by `wrap`.

    Attributes:
      loss_scale: the loss-scale state (a `LossScale` pytree of scalar arrays).
      inner_state: the wrapped transformation's state; unchanged, bit for bit, by a
        skipped step.
      pending_overwrite: None, except when Flax fp8 metadata is trained through a
        wrapped `optax.MultiSteps`: their elementwise max over the micro-steps of
        the current accumulation, written when the inner optimizer steps.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import lossscale
      >>> opt_state = lossscale.wrap(optax.adam(1e-3), 256.0).init(jnp.zeros(2))
      >>> print(type(opt_state).__name__, opt_state.loss_scale.scale)
      WrapState 256.0
      >>> print(opt_state.inner_state[0].count)
      0
    """

    loss_scale: LossScale
    inner_state: optax.OptState
    pending_overwrite: Any = None


def wrap(
    inner: optax.GradientTransformation,
    loss_scale: kinds.LossScaleLike = "dynamic",
    *,
    axis_name: checks.AxisName | None = None,
    clip_norm: float | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optax transformation with loss scaling.

    The returned transformation's `update` takes the gradients of the *scaled* loss
    (see `lossscale.scale_loss`). Each step it:

    1. checks, in one pass over the gradients, whether the unscaled gradients are
       all finite;
    2. under one `jax.lax.cond`, either runs `inner.update` on the gradients
       divided by the scale (a float16 gradient of a float32 parameter is
       unscaled into float32), or skips it: the updates are negative zeros, which
       `optax.apply_updates` adds without changing any parameter bit, and the
       inner state comes back untouched, so moments, counts and schedules do not
       advance;
    3. updates the loss-scale state with `lossscale.update`; the unscaling used
       the scale the loss was multiplied by.

    Every kind of loss scale skips non-finite steps, static and no-op included
    (TF's `FixedLossScale` applies them). Pass the unscaled loss as
    `update(..., value=loss)` to tell forward from backward overflows: a
    non-finite `value` skips the step without backing off the scale, and
    `lossscale.metrics` counts the two apart; `value` also reaches `inner`, like
    every extra argument. Transformations inside `inner` (e.g.
    `optax.clip_by_global_norm`) see the unscaled gradients; `clip_norm=c` does
    what `optax.clip_by_global_norm(c)` first in `inner` would, in the check's
    pass. The result composes with `optax.chain`, `optax.MultiSteps` and
    `optax.inject_hyperparams`. Why each step is computed as it is:
    `docs/design.md`.

    Under `jax.jit` with sharded arrays the decision is global as it is. Inside
    `shard_map` or `pmap`, pass the mapped axis as `axis_name`: one scalar
    collective makes every device take the same decision and keep the same
    loss-scale state.

    Args:
      inner: the optax transformation to wrap (an `optax.MultiSteps` is taken
        as its `gradient_transformation()`).
      loss_scale: a loss-scale state, a number (a static scale), `"dynamic"` (a
        default `DynamicLossScale()`) or `None` (no scaling).
      axis_name: a `shard_map`/`pmap` axis name (or tuple of names) to agree on
        the skip decision over; None under plain `jax.jit`.
      clip_norm: None, or the global norm to clip the unscaled gradients to
        before `inner`. A scaled float32 gradient whose square overflows (above
        1.8e19) counts as an overflow, and the scale backs off.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a `WrapState`.

    Raises:
      TypeError: if `inner` is not an optax transformation, `loss_scale` is not
        one of the above, `axis_name` is not a str or a tuple of str, or
        `clip_norm` is not a number.
      ValueError: if `loss_scale` is an unknown string or an invalid number, or
        `clip_norm` is not positive and finite. The transformation's `init`
        raises `ValueError` if `inner` is already wrapped; its `update` raises
        `TypeError` for non-float gradients and `ValueError` for gradients whose
        tree differs from `params`.

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import lossscale
      >>> tx = lossscale.wrap(optax.sgd(0.25))
      >>> params = jnp.array(1.0)
      >>> opt_state = tx.init(params)
      >>> @jax.jit
      ... def step(params, opt_state):
      ...     loss_fn = lambda p: lossscale.scale_loss(p**2, opt_state)
      ...     grads = jax.grad(loss_fn)(params)
      ...     updates, opt_state = tx.update(grads, opt_state, params)
      ...     return optax.apply_updates(params, updates), opt_state
      >>> params, opt_state = step(params, opt_state)
      >>> print(params)
      0.5
    """
    accumulates = isinstance(inner, optax.MultiSteps)
    if accumulates:
        inner = inner.gradient_transformation()
    checks.check_transformation(inner, "inner")
    inner = optax.with_extra_args_support(inner)
    template = kinds.from_spec(loss_scale)
    options = checks.step_options(axis_name, clip_norm)

    def init_fn(params):
        trainable, fp8_metadata = fp8.split_off(params, "params")
        inner_state = inner.init(trainable)
        lookup.refuse_wrapped(inner_state, "inner", "`lossscale.wrap`")
        # Under accumulation, fp8 metadata combine with max until the inner
        # optimizer steps (design.md, "fp8 metadata").
        pending = None
        if accumulates and fp8_metadata is not None:
            pending = fp8.unproduced_like(fp8_metadata)
        # Fresh buffers on every call, so the state is safe to donate.
        return WrapState(kinds.fresh_copy(template), inner_state, pending)

    def update_fn(updates, state, params=None, **extra_args):
        if not isinstance(state, WrapState):
            raise TypeError(
                "`state` must be the `WrapState` returned by this transformation's"
                f" `init`, got {type(state).__name__}."
            )

        split = fp8.split(updates, params)

        def inner_step(grads, carry):
            inner_state, pending = carry
            updates, new_inner_state = inner.update(
                grads, inner_state, split.params, **extra_args
            )
            if split.old is None:
                return (updates, None), (new_inner_state, pending)
            if pending is None:
                written = fp8.written(split.new, split.old)
            else:
                pending = fp8.maximum(pending, split.new)
                stepped = new_inner_state.mini_step == 0  # MultiSteps emitted
                written = jax.tree.map(
                    lambda new, old: jnp.where(stepped, new, old),
                    fp8.written(pending, split.old),
                    split.old,
                )
                pending = jax.tree.map(
                    lambda p: jnp.where(stepped, -jnp.inf, p), pending
                )
            return (updates, fp8.differences(written, split.old)), (
                new_inner_state,
                pending,
            )

        (updates, differences), (inner_state, pending), loss_scale, _ = (
            step.guarded_step(
                state.loss_scale,
                split.grads,
                split.params,
                extra_args.get("value"),
                options,
                inner_step,
                (state.inner_state, state.pending_overwrite),
            )
        )
        updates = fp8.merge(updates, differences)
        return updates, WrapState(loss_scale, inner_state, pending)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
