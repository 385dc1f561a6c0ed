"""A dynamic loss-scale state closed over by a jitted function: warned, not silent.

Compiled, such a function keeps the scale the state had when it was traced; once
the optimizer's scale moves, the loss is multiplied by the stale one (updates half
as large after a growth, and so on) and nothing fails.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import lossscale
import lossscale.flax

CLOSED_OVER = "constant of the function being traced"


def loss_fn(w):
    return jnp.sum(w**2)


def uses():
    """Each way a step reads the state, as `f(state, params)`."""
    return {
        "scale_loss": lambda s, w: jax.grad(
            lambda w: lossscale.scale_loss(loss_fn(w), s)
        )(w),
        "value_and_grad": lambda s, w: lossscale.value_and_grad(loss_fn)(s, w)[1],
        "get_loss_scale": lambda s, w: w * lossscale.get_loss_scale(s).scale,
        "metrics": lambda s, w: w * lossscale.metrics(s)["loss_scale"],
    }


def holders(params):
    """A dynamic state as each container holds it."""
    tx = lossscale.wrap(optax.sgd(0.1))
    return {
        "state": lossscale.DynamicLossScale(),
        "opt_state": tx.init(params),
        "train_state": lossscale.flax.TrainState.create(
            apply_fn=None, params=params, tx=optax.sgd(0.1)
        ),
    }


@pytest.mark.parametrize("holder", ["state", "opt_state", "train_state"])
@pytest.mark.parametrize("use", sorted(uses()))
def test_a_closed_over_dynamic_state_is_warned_about(use, holder):
    params = jnp.ones(3)
    state = holders(params)[holder]
    f = uses()[use]
    with pytest.warns(UserWarning, match=CLOSED_OVER) as caught:
        jax.jit(lambda w: f(state, w))(params)
    assert "as an argument of the jitted function" in str(caught[0].message)


@pytest.mark.parametrize("holder", ["state", "opt_state", "train_state"])
@pytest.mark.parametrize("use", sorted(uses()))
def test_the_state_as_an_argument_or_eager_is_silent(use, holder):
    params = jnp.ones(3)
    state = holders(params)[holder]
    f = uses()[use]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jitted = jax.jit(f)(state, params)  # an argument: traced
        eager = f(state, params)  # eager, `jax.grad` included
    np.testing.assert_array_equal(jitted, eager)


def test_a_fixed_scale_closed_over_is_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for state in (lossscale.StaticLossScale(8.0), lossscale.NoOpLossScale()):
            jax.jit(lambda w, s=state: uses()["scale_loss"](s, w))(jnp.ones(3))


def test_an_nnx_optimizer_closed_over_by_nnx_jit_is_warned_about():
    # As a framework's step that reads the optimizer from `self` while `nnx.jit`
    # is given a copy (tunix's trainer, through a closure).
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    optimizer = lossscale.flax.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def loss(model, x):
        return lossscale.scale_loss(jnp.sum(model(x)), optimizer)

    @nnx.jit
    def closed(model, x):
        return nnx.grad(loss)(model, x)

    @nnx.jit
    def passed(model, optimizer, x):
        return nnx.grad(lambda m: lossscale.scale_loss(jnp.sum(m(x)), optimizer))(model)

    x = jnp.ones((2, 3))
    with pytest.warns(UserWarning, match=CLOSED_OVER):
        closed(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        passed(model, optimizer, x)


def test_the_stale_scale_the_warning_is_about():
    # The reference: what a closed-over state does once the scale grows.
    params = jnp.ones(3)
    state = lossscale.DynamicLossScale(2.0**10)
    with pytest.warns(UserWarning, match=CLOSED_OVER):
        stale = jax.jit(lambda w: uses()["scale_loss"](state, w))
        stale(params)
    state = state.replace(scale=jnp.float32(2.0**11))
    np.testing.assert_array_equal(stale(params), 2.0 * params * 2.0**10)
    np.testing.assert_array_equal(uses()["scale_loss"](state, params), 2.0 * 2.0**11)
