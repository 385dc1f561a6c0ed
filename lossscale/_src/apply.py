"""The whole optimizer step in one call: unscale, update and apply, or skip."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from lossscale._src import loss_scale as loss_scale_lib
from lossscale._src import scaling


def apply_gradients(
    tx: optax.GradientTransformation,
    *,
    grads: Any,
    params: Any,
    opt_state: optax.OptState,
    loss_scale: loss_scale_lib.LossScale,
    value: jax.typing.ArrayLike | None = None,
    axis_name: scaling.AxisName | None = None,
    clip_norm: float | None = None,
    **extra_args: Any,
) -> tuple[Any, optax.OptState, loss_scale_lib.LossScale]:
    """Applies the gradients of a scaled loss with `tx`, or skips the step.

    The functional form of `lossscale.flax.TrainState.apply_gradients`, for train
    steps written with optax alone. It does what `lossscale.wrap(tx)` followed by
    `optax.apply_updates` does, with the same results bit for bit, but puts the
    unscaling, `tx.update` *and* `optax.apply_updates` inside the applied branch of
    one `jax.lax.cond`. Only the new parameters and optimizer state cross the cond,
    never a tree of updates, so the step costs about one read of the gradients more
    than the unscaled step (XLA's figures in the README's performance section),
    where `wrap` must hand the updates to the caller.

    A step is applied when every unscaled gradient is finite (and `value`, if
    given, is finite); otherwise `params` and `opt_state` come back unchanged, bit
    for bit, and only the loss-scale state moves (see `lossscale.update`).

    Args:
      tx: the optax optimizer, not wrapped with `lossscale.wrap`.
      grads: the gradients of the *scaled* loss (`lossscale.scale_loss`), with
        the tree structure of `params`.
      params: the parameters.
      opt_state: `tx`'s state, from `tx.init(params)`.
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
    check_transformation(tx, "tx")
    if not isinstance(loss_scale, loss_scale_lib.LossScale):
        raise TypeError(
            "`loss_scale` must be a loss-scale state (e.g."
            " `lossscale.DynamicLossScale()`), carried from step to step, got"
            f" {type(loss_scale).__name__}. (A number or 'dynamic' would start"
            " afresh every step.)"
        )
    scaling.check_axis_name(axis_name)
    clip_norm = check_clip_norm(clip_norm)
    if loss_scale_lib.find_loss_scales(opt_state):
        raise ValueError(
            "`opt_state` holds a loss-scale state: `tx` is wrapped with"
            " `lossscale.wrap` already. Pass the unwrapped optimizer and its state;"
            " `apply_gradients` unscales the gradients itself."
        )
    if value is not None:
        extra_args["value"] = value
    params, opt_state, loss_scale, _ = apply_or_skip(
        tx, grads, params, opt_state, loss_scale, axis_name, clip_norm, extra_args
    )
    return params, opt_state, loss_scale


def apply_or_skip(
    tx: optax.GradientTransformation,
    grads: Any,
    params: Any,
    opt_state: optax.OptState,
    loss_scale: loss_scale_lib.LossScale,
    axis_name: scaling.AxisName | None,
    clip_norm: float | None,
    extra_args: dict[str, Any],
) -> tuple[Any, optax.OptState, loss_scale_lib.LossScale, jax.Array]:
    """`apply_gradients` on checked settings; also returns whether it applied."""
    scaling.check_gradients(grads, params)
    grads_finite, loss_finite, norm = finite_flags(
        grads, params, loss_scale, extra_args.get("value"), axis_name, clip_norm
    )
    applied = grads_finite & loss_finite
    if extra_args:
        tx = optax.with_extra_args_support(tx)

    def apply_step(operands):
        params, opt_state, grads = operands
        updates, opt_state = tx.update(
            unscaled(grads, params, loss_scale, norm, clip_norm),
            opt_state,
            params,
            **extra_args,
        )
        return optax.apply_updates(params, updates), opt_state

    def skip_step(operands):
        params, opt_state, _ = operands
        return params, opt_state

    operands = (params, opt_state, grads)
    check_same_types(jax.eval_shape(apply_step, operands), (params, opt_state))
    params, opt_state = jax.lax.cond(applied, apply_step, skip_step, operands)
    loss_scale = loss_scale_lib.update(loss_scale, grads_finite, loss_finite)
    return params, opt_state, loss_scale, applied


def finite_flags(
    grads: Any,
    params: Any,
    loss_scale: loss_scale_lib.LossScale,
    value: Any,
    axis_name: scaling.AxisName | None,
    clip_norm: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Whether the unscaled gradients, and the loss `value`, are finite.

    With `clip_norm`, the check is the gradients' global norm (also returned), so
    clipping costs no pass of its own; else the norm is None.
    """
    loss_finite = jnp.asarray(True) if value is None else scaling.loss_is_finite(value)
    if clip_norm is None:
        norm = None
        grads_finite = scaling.finite_after_unscale(grads, loss_scale, params)
    else:
        norm = scaling.global_norm_after_unscale(grads, loss_scale, params)
        grads_finite = jnp.isfinite(norm)
    # One collective for both flags, when there is one.
    grads_finite, loss_finite = scaling.agree(
        jnp.stack([grads_finite, loss_finite]), axis_name
    )
    return grads_finite, loss_finite, norm


def unscaled(
    grads: Any,
    params: Any,
    loss_scale: loss_scale_lib.LossScale,
    norm: jax.Array | None,
    clip_norm: float | None,
) -> Any:
    """The gradients the inner transformation sees: unscaled, clipped if asked."""
    grads = scaling.unscale(grads, loss_scale, params)
    return grads if clip_norm is None else scaling.clip(grads, norm, clip_norm)


def check_clip_norm(clip_norm: Any) -> float | None:
    """`clip_norm` as a float, or None; raises for anything but a positive number."""
    if clip_norm is None:
        return None
    if isinstance(clip_norm, bool) or not isinstance(clip_norm, int | float):
        raise TypeError(
            "`clip_norm` must be None or a positive number (the global norm to clip"
            f" the unscaled gradients to), got {type(clip_norm).__name__}."
        )
    if not 0 < clip_norm < float("inf"):
        raise ValueError(f"`clip_norm` must be positive and finite, got {clip_norm!r}.")
    return float(clip_norm)


def check_transformation(tx: Any, name: str) -> None:
    """Raises `TypeError` unless `tx` is an optax transformation."""
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(
            f"`{name}` must be an optax transformation (e.g. `optax.adam(1e-3)`),"
            f" got {type(tx).__name__}."
        )


def check_same_types(new_state: Any, old_state: Any) -> None:
    """Raises a clear error if an update changed its state's tree or leaf types."""
    new_paths, new_def = jax.tree_util.tree_flatten_with_path(new_state)
    old_leaves, old_def = jax.tree.flatten(old_state)
    if new_def != old_def:
        raise ValueError(
            "The inner transformation's `update` returned a state with another tree"
            f" structure than it was given: {new_def} vs {old_def}."
        )
    for (path, new), old in zip(new_paths, old_leaves, strict=True):
        old_shape, old_dtype = jnp.shape(old), jnp.result_type(old)
        if new.shape != old_shape or new.dtype != old_dtype:
            raise TypeError(
                "The inner transformation's `update` changed the state leaf at"
                f" {jax.tree_util.keystr(path)} from {old_dtype}{list(old_shape)} to"
                f" {new.dtype}{list(new.shape)}; a skipped step could not keep it."
                " Initialise the inner state with the dtypes its update produces."
            )
