"""Train steps as a user's code writes them: every line must type-check."""

from collections.abc import Callable
from typing import Any
from typing import assert_type

import jax
import jax.numpy as jnp
import optax

import lossscale


def loss_fn(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return jnp.mean((params["w"] * x) ** 2)


def functional_step(
    tx: optax.GradientTransformation,
    params: dict[str, jax.Array],
    opt_state: optax.OptState,
    loss_scale: lossscale.DynamicLossScale,
    x: jax.Array,
) -> tuple[Any, optax.OptState, lossscale.DynamicLossScale]:
    loss, grads = lossscale.value_and_grad(loss_fn)(loss_scale, params, x)
    result = lossscale.apply_gradients(
        tx,
        grads=grads,
        params=params,
        opt_state=opt_state,
        loss_scale=loss_scale,
        value=loss,
        clip_norm=1.0,
    )
    # The state comes back of the kind it went in as.
    assert_type(result[2], lossscale.DynamicLossScale)
    assert_type(result[2].counter, jax.Array)
    return result


def any_kind_step(
    tx: optax.GradientTransformation,
    params: jax.Array,
    opt_state: optax.OptState,
    loss_scale: lossscale.LossScale,
) -> jax.Array:
    grads = jax.grad(lambda p: lossscale.scale_loss(jnp.sum(p**2), loss_scale))(params)
    grads = lossscale.unscale_grads(grads, loss_scale)
    finite = lossscale.all_finite(grads)
    assert_type(finite, jax.Array)
    params, opt_state, loss_scale = lossscale.apply_gradients(
        tx, grads=grads, params=params, opt_state=opt_state, loss_scale=loss_scale
    )
    assert_type(loss_scale, lossscale.LossScale)
    assert_type(lossscale.update(loss_scale, finite), lossscale.LossScale)
    return loss_scale.scale


def wrapped_step(params: jax.Array, x: jax.Array) -> jax.Array:
    tx = lossscale.wrap(optax.adam(1e-3), "dynamic", clip_norm=1.0)
    lossscale.wrap(optax.sgd(0.1), lossscale.StaticLossScale(1024))
    lossscale.wrap(optax.sgd(0.1), 1024.0)
    lossscale.wrap(optax.sgd(0.1), None)
    opt_state = tx.init(params)
    loss_scale = lossscale.get_loss_scale(opt_state)
    assert_type(loss_scale, lossscale.LossScale)
    assert_type(loss_scale.scale, jax.Array)
    assert_type(loss_scale.skipped_steps, jax.Array)
    assert_type(lossscale.metrics(opt_state), dict[str, jax.Array])
    assert_type(
        lossscale.diagnostics.leaf_path(params, loss_scale.overflow_leaf), str | None
    )
    lossscale.checkpoints.check_config(loss_scale.get_config(), loss_scale)
    scaled_fn = lossscale.scale_loss(lambda: jnp.sum(params * x), opt_state)
    assert_type(scaled_fn, Callable[[], jax.Array])
    return lossscale.scale_loss(jnp.sum(params * x), opt_state)
