"""Flax's train states with loss scaling, as a user's code writes them."""

from typing import Any
from typing import assert_type

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import lossscale
import lossscale.flax


def linen_step(state: lossscale.flax.TrainState, x: jax.Array) -> jax.Array:
    def loss_fn(params: Any) -> jax.Array:
        return jnp.mean(state.apply_fn(params, x) ** 2)

    loss, grads = lossscale.value_and_grad(loss_fn)(state, state.params)
    new = state.apply_gradients(grads=grads, value=loss)
    assert_type(new, lossscale.flax.TrainState)
    assert_type(new.loss_scale, lossscale.LossScale)
    assert_type(new.loss_scale.scale, jax.Array)
    return new.loss_scale.skipped_steps


class BatchNormState(lossscale.flax.TrainState):
    batch_stats: Any = None


def subclass_step(state: BatchNormState, grads: Any, stats: Any) -> None:
    # A subclass's methods return the subclass.
    assert_type(state.apply_gradients(grads=grads, batch_stats=stats), BatchNormState)
    created = BatchNormState.create(
        apply_fn=lambda params, x: params["w"] * x,
        params={"w": jnp.array(1.0)},
        tx=optax.sgd(0.25),
        loss_scale=lossscale.DynamicLossScale(scale=2.0**10),
        clip_norm=1.0,
        batch_stats={},
    )
    assert_type(created, BatchNormState)


def nnx_step(model: nnx.Linear, x: jax.Array) -> None:
    optimizer = lossscale.flax.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    assert_type(optimizer.loss_scale, lossscale.LossScale)

    def loss_fn(model: nnx.Linear) -> jax.Array:
        return lossscale.scale_loss(jnp.mean(model(x) ** 2), optimizer)

    optimizer.update(model, nnx.grad(loss_fn)(model))
