"""The optax wrapper: unscale, check, skip non-finite steps, update the scale."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from lossscale._src import apply
from lossscale._src import loss_scale as loss_scale_lib
from lossscale._src import scaling


class WrapState(NamedTuple):
    """State of the `optax.GradientTransformationExtraArgs` returned by `wrap`.

    Attributes:
      loss_scale: the loss-scale state (a `LossScale` pytree of scalar arrays).
      inner_state: the wrapped transformation's state; unchanged, bit for bit, by a
        skipped step.

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

    loss_scale: loss_scale_lib.LossScale
    inner_state: optax.OptState


def wrap(
    inner: optax.GradientTransformation,
    loss_scale: loss_scale_lib.LossScaleLike = "dynamic",
    *,
    axis_name: scaling.AxisName | None = None,
    clip_norm: float | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optax transformation with loss scaling.

    The returned transformation's `update` takes the gradients of the *scaled* loss
    (see `lossscale.scale_loss`). Each step it:

    1. checks with one `jnp.isfinite` reduction over the gradients whether the
       unscaled gradients are all finite;
    2. with `jax.lax.cond`, either runs `inner.update` on the gradients divided by
       the scale (the division sits inside the applied branch, where XLA fuses it
       into the inner update; a gradient narrower than its parameter, float16 for
       a float32 parameter, is unscaled into the parameter's dtype, so small
       values do not underflow again), or skips it: the updates are zeros and the
       inner state is returned untouched, so moments, step counts and schedules
       do not advance (the zeros are negative zeros, so `optax.apply_updates`
       leaves every parameter bit for bit as it was);
    3. updates the loss-scale state with `lossscale.update`, using the scale the
       loss was multiplied by for the unscaling.

    Steps with non-finite gradients are skipped with every kind of loss scale,
    static and no-op included (TF's `FixedLossScale` applies them instead).

    Pass the unscaled loss as `update(..., value=loss)` to tell overflows in the
    forward pass from those in the backward pass: a non-finite `value` skips the
    step without backing off the scale (a lower scale cannot fix the forward
    pass), and `lossscale.metrics` counts the two kinds apart. `value` is passed on
    to `inner` like any extra argument.

    Under `jax.jit` with sharded arrays the decision is global as it is. Inside
    `shard_map` or `pmap`, where each device holds its own gradients (or shards of
    them), pass the mapped axis as `axis_name`: the decision is then reduced over
    it (one scalar collective), so one device's overflow makes every device skip,
    and every device keeps the same loss-scale state.

    Anything placed inside `inner`, such as `optax.clip_by_global_norm`, sees the
    true (unscaled) gradients. `clip_norm=c` does what
    `optax.clip_by_global_norm(c)` first in `inner` would, cheaper: the global
    norm of the gradients *is* the finiteness check (it is NaN or inf exactly when
    a gradient is), so clipping costs no pass over the gradients of its own, and
    its multiply fuses into the inner update. The squares are summed in the scaled
    domain; an overflow of a square (a scaled float32 gradient above 1.8e19) is
    taken for a gradient overflow, and the scale backs off.

    The result composes with `optax.chain`, `optax.MultiSteps` and
    `optax.inject_hyperparams`; extra arguments of `update` are passed on to
    `inner`.

    Args:
      inner: the optax transformation to wrap (an `optax.MultiSteps` is taken
        as its `gradient_transformation()`).
      loss_scale: a loss-scale state, a number (a static scale), `"dynamic"` (a
        default `DynamicLossScale()`) or `None` (no scaling).
      axis_name: a `shard_map`/`pmap` axis name (or tuple of names) to agree on
        the skip decision over; None under plain `jax.jit`.
      clip_norm: None, or the global norm to clip the unscaled gradients to
        before `inner` (see above).

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
    if isinstance(inner, optax.MultiSteps):
        inner = inner.gradient_transformation()
    apply.check_transformation(inner, "inner")
    inner = optax.with_extra_args_support(inner)
    template = loss_scale_lib.as_loss_scale(loss_scale)
    scaling.check_axis_name(axis_name)
    clip_norm = apply.check_clip_norm(clip_norm)

    def init_fn(params):
        inner_state = inner.init(params)
        if loss_scale_lib.find_loss_scales(inner_state):
            raise ValueError(
                "`inner` already holds a loss-scale state: it is wrapped already."
                " Wrap an optimizer once: nested wraps would unscale twice."
            )
        # Fresh buffers on every call, so the state is safe to donate.
        fresh = jax.tree.map(lambda x: jnp.array(x, copy=True), template)
        return WrapState(loss_scale=fresh, inner_state=inner_state)

    def update_fn(updates, state, params=None, **extra_args):
        if not isinstance(state, WrapState):
            raise TypeError(
                "`state` must be the `WrapState` returned by this transformation's"
                f" `init`, got {type(state).__name__}."
            )
        scaling.check_gradients(updates, params)
        current = state.loss_scale
        grads_finite, loss_finite, norm = apply.finite_flags(
            updates, params, current, extra_args.get("value"), axis_name, clip_norm
        )
        applied = grads_finite & loss_finite

        def apply_step(operands):
            grads, inner_state, params = operands
            return inner.update(
                apply.unscaled(grads, params, current, norm, clip_norm),
                inner_state,
                params,
                **extra_args,
            )

        operands = (updates, state.inner_state, params)
        # The skipped branch must match the applied one's output types: the inner
        # update may change dtypes (float16 gradients, float32 updates), which is
        # where `optax.apply_if_finite` fails.
        applied_types = jax.eval_shape(apply_step, operands)

        def skip_step(operands):
            _, inner_state, _ = operands
            # Negative zeros: `p + (-0.0)` is `p` bit for bit, even for p = -0.0
            # (with +0.0 it would come back +0.0), so applying them changes nothing.
            # `full_like` of the applied types also keeps their `shard_map` typing
            # (which axes the values vary over).
            zeros = jax.tree.map(lambda t: jnp.full_like(t, -0.0), applied_types[0])
            return zeros, inner_state

        apply.check_same_types(applied_types[1], state.inner_state)
        new_updates, new_inner_state = jax.lax.cond(
            applied, apply_step, skip_step, operands
        )
        return new_updates, WrapState(
            loss_scale=loss_scale_lib.update(current, grads_finite, loss_finite),
            inner_state=new_inner_state,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
