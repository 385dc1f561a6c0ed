"""The whole optimizer step in one call: unscale, update and apply, or skip."""

from __future__ import annotations

from typing import Any

import jax
import optax

from lossscale._src import checks
from lossscale._src import fp8
from lossscale._src import lookup
from lossscale._src import step
from lossscale._src.base import LossScale


def apply_gradients(
    tx: optax.GradientTransformation,
    *,
    grads: Any,
    params: Any,
    opt_state: optax.OptState,
    loss_scale: LossScale,
    value: jax.typing.ArrayLike | None = None,
    axis_name: checks.AxisName | None = None,
    clip_norm: float | None = None,
    **extra_args: Any,
) -> tuple[Any, optax.OptState, LossScale]:
    """Applies the gradients of a scaled loss with `tx`, or skips the step.

    The functional form of `lossscale.flax.TrainState.apply_gradients`, for train
    steps written with optax alone. It does what `lossscale.wrap(tx)` followed by
    `optax.apply_updates` does, with the same results bit for bit, but puts the
    unscaling, `tx.update` *and* `optax.apply_updates` inside the applied branch of
    one `jax.lax.cond`. Only the new parameters and optimizer state cross the cond,
    never a tree of updates, so the step costs about one read of the gradients more
    than the unscaled step (XLA's figures in the docs' performance guide),
    where `wrap` must hand the updates to the caller.

    A step is applied when every unscaled gradient is finite (and `value`, if
    given, is finite); otherwise `params` and `opt_state` come back unchanged, bit
    for bit, and only the loss-scale state moves (see `lossscale.update`).

    Args:
      tx: the optax optimizer, not wrapped with `lossscale.wrap`.
      grads: the gradients of the *scaled* loss (`lossscale.scale_loss`), with
        the tree structure of `params`.
      params: the parameters. With Flax's fp8 layers, the whole variables dict
        `{"params": ..., "_overwrite_with_gradient": ...}`: the fp8 metadata take
        their new values from `grads` on applied steps, bypassing `tx` (see
        `lossscale.flax.TrainState`).
      opt_state: `tx`'s state, from `tx.init(params)` (without the fp8
        collection, if any).
      loss_scale: the loss-scale state (`lossscale.DynamicLossScale()`, ...),
        carried from step to step like `opt_state`.
      value: the unscaled loss, optional. A non-finite `value` is an overflow in
        the forward pass: the step is skipped without backing off the scale.
        It is passed on to `tx` like the other extra arguments.
      axis_name: a `shard_map`/`pmap` axis name (or tuple of names) to agree on
        the skip decision over, as in `lossscale.wrap`; None under plain `jit`.
      clip_norm: clip the unscaled gradients to this global norm before `tx`, as
        `optax.clip_by_global_norm(clip_norm)` first in `tx` would, but in the
        same pass over the gradients as the finiteness check (see `lossscale.wrap`).
      **extra_args: extra arguments for `tx.update`.

    Returns:
      `(params, opt_state, loss_scale)`, the next ones.

    Raises:
      TypeError: if `tx` is not an optax transformation, `loss_scale` is not a
        loss-scale state, `axis_name` or `clip_norm` is invalid, a gradient is
        not floating point, or `tx.update` changes the dtype of a state leaf.
      ValueError: if `grads` and `params` differ in tree structure, `clip_norm`
        is not positive and finite, or `opt_state` holds a loss-scale state
        (`tx` is wrapped already).

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import lossscale
      >>> tx = optax.sgd(0.25)
      >>> params = jnp.array(1.0)
      >>> opt_state, loss_scale = tx.init(params), lossscale.DynamicLossScale()
      >>> @jax.jit
      ... def train_step(params, opt_state, loss_scale, x):
      ...     loss_fn = lambda p: (p * x) ** 2
      ...     loss, grads = lossscale.value_and_grad(loss_fn)(loss_scale, params)
      ...     return lossscale.apply_gradients(
      ...         tx, grads=grads, params=params, opt_state=opt_state,
      ...         loss_scale=loss_scale, value=loss,
      ...     )
      >>> params, opt_state, loss_scale = train_step(
      ...     params, opt_state, loss_scale, jnp.array(1.0))
      >>> print(params)
      0.5
      >>> params, opt_state, loss_scale = train_step(  # a forward overflow
      ...     params, opt_state, loss_scale, jnp.array(jnp.inf))
      >>> print(params, loss_scale.scale, loss_scale.forward_overflows)
      0.5 32768.0 1
    """
    checks.check_transformation(tx, "tx")
    if not isinstance(loss_scale, LossScale):
        raise TypeError(
            "`loss_scale` must be a loss-scale state (e.g."
            " `lossscale.DynamicLossScale()`), carried from step to step, got"
            f" {type(loss_scale).__name__}. (A number or 'dynamic' would start"
            " afresh every step.)"
        )
    options = checks.step_options(axis_name, clip_norm)
    lookup.refuse_wrapped(opt_state, "opt_state", "`apply_gradients`")
    trainable = fp8.trainable(params)
    if trainable is not params and jax.tree.structure(
        jax.eval_shape(tx.init, trainable)
    ) != jax.tree.structure(opt_state):
        raise ValueError(
            f"`params` holds Flax's fp8 `{fp8.OVERWRITE}` collection, which"
            " no optimizer sees: build `opt_state` with `tx.init` of the other"
            " collections, e.g. `tx.init({k: v for k, v in params.items() if k !="
            f" '{fp8.OVERWRITE}'}})`."
        )
    if value is not None:
        extra_args["value"] = value
    params, opt_state, loss_scale, _ = apply_or_skip(
        tx, grads, params, opt_state, loss_scale, options, extra_args
    )
    return params, opt_state, loss_scale


def apply_or_skip(
    tx: optax.GradientTransformation,
    grads: Any,
    params: Any,
    opt_state: optax.OptState,
    loss_scale: LossScale,
    options: checks.StepOptions,
    extra_args: dict[str, Any],
) -> tuple[Any, optax.OptState, LossScale, jax.Array]:
    """`apply_gradients` on checked arguments; also returns whether it applied."""
    if extra_args:
        tx = optax.with_extra_args_support(tx)

    split = fp8.split(grads, params)

    def optimizer_step(grads, carry):
        params, opt_state, metadata = carry
        updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
        params = optax.apply_updates(params, updates)
        if metadata is not None:
            metadata = fp8.written(split.new, metadata)
        return None, (params, opt_state, metadata)

    _, (params, opt_state, metadata), loss_scale, applied = step.guarded_step(
        loss_scale,
        split.grads,
        split.params,
        extra_args.get("value"),
        options,
        optimizer_step,
        (split.params, opt_state, split.old),
    )
    return fp8.merge(params, metadata), opt_state, loss_scale, applied
