"""Helpers shared by several test modules."""

import jax
import optax

import lossscale


def scaled_loss_step(tx, loss_fn):
    """A jitted train step: gradients of the scaled `loss_fn(p, x, y)`, then `tx`."""

    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(lambda p: lossscale.scale_loss(loss_fn(p, x, y), opt_state))(
            params
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step
