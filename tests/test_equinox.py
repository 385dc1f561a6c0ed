"""Equinox: filtered models, `None` gradient leaves and leaves that are not arrays.

An `eqx.nn.MLP` holds float32 arrays and its activation functions; its gradients from
`eqx.filter_grad` hold `None` for the functions. Every public function must take
such trees, and a wrapped step must equal the plain optimizer's on the applied steps
and leave the model untouched on the skipped ones.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_one_step_close
from helpers import tree_equal

import lossscale

SCALE = lossscale.StaticLossScale(2.0**10)


def mlp():
    return eqx.nn.MLP(4, 2, width_size=8, depth=2, key=jax.random.key(0))


def loss_fn(model, x, y):
    half = jax.tree.map(
        lambda v: v.astype(jnp.float16) if eqx.is_inexact_array(v) else v, model
    )
    prediction = jax.vmap(half)(x.astype(jnp.float16)).astype(jnp.float32)
    return jnp.mean((prediction - y) ** 2)


def batch(poison=False):
    x = jax.random.normal(jax.random.key(1), (16, 4))
    return (x * jnp.inf if poison else x), jnp.ones((16, 2))


def scaled_grads(model, loss_scale, poison=False):
    x, y = batch(poison)
    return eqx.filter_grad(
        lambda m: lossscale.scale_loss(loss_fn(m, x, y), loss_scale)
    )(model)


def test_gradients_of_a_filtered_model_hold_none_and_functions_are_skipped():
    model = mlp()
    grads = scaled_grads(model, SCALE)
    nones = jax.tree.leaves(grads, is_leaf=lambda v: v is None)
    assert any(v is None for v in nones)  # the activation functions
    assert any(callable(v) for v in jax.tree.leaves(model))
    unscaled = lossscale.unscale_grads(grads, SCALE)
    assert jax.tree.structure(unscaled, is_leaf=lambda v: v is None) == (
        jax.tree.structure(grads, is_leaf=lambda v: v is None)
    )
    x, y = batch()
    expected = eqx.filter_grad(loss_fn)(model, x, y)
    for got, want in zip(
        jax.tree.leaves(unscaled), jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
    # all_finite takes the whole model (functions and all), and the gradients.
    assert bool(lossscale.all_finite(model)) and bool(lossscale.all_finite(grads))
    assert not bool(lossscale.all_finite(scaled_grads(model, SCALE, poison=True)))
    stats = lossscale.diagnostics.grad_stats(unscaled, SCALE)
    assert float(stats["zero_fraction"]) < 1.0


@pytest.mark.slow  # a training run
@pytest.mark.parametrize("path", ["wrap", "apply_gradients"])
def test_a_filtered_model_trains_exactly_and_skips_bitwise(path):
    inner = optax.adam(1e-2)
    model = mlp()
    params = eqx.filter(model, eqx.is_inexact_array)
    if path == "wrap":
        tx = lossscale.wrap(inner, SCALE)
        opt_state = tx.init(params)
    else:
        opt_state, loss_scale = inner.init(params), SCALE
    ref_state = previous_state = inner.init(params)

    @eqx.filter_jit
    def step(model, opt_state, poison):
        grads = scaled_grads(model, SCALE, poison)
        params = eqx.filter(model, eqx.is_inexact_array)
        if path == "wrap":
            updates, opt_state = tx.update(grads, opt_state, params)
            return eqx.apply_updates(model, updates), opt_state
        params, opt_state, _ = lossscale.apply_gradients(
            inner,
            grads=grads,
            params=params,
            opt_state=opt_state,
            loss_scale=loss_scale,
        )
        return eqx.combine(params, model), opt_state

    for poison in [False, True, False]:
        before = model
        model, opt_state = step(model, opt_state, poison)
        if poison:
            assert tree_equal(
                eqx.filter(model, eqx.is_array), eqx.filter(before, eqx.is_array)
            )
            continue
        # The reference takes the same step from the same model (so differences
        # do not compound): the optimizer on the unscaled float16 gradients,
        # eagerly, a program of its own; hence a one-step tolerance.
        x, y = batch()
        grads = eqx.filter_grad(loss_fn)(before, x, y)
        updates, ref_state = inner.update(
            grads, ref_state, eqx.filter(before, eqx.is_inexact_array)
        )
        reference = eqx.apply_updates(before, updates)
        assert_one_step_close(
            *(eqx.filter(m, eqx.is_array) for m in (before, reference, model)),
            name="model",
        )
        inner_state = opt_state.inner_state if path == "wrap" else opt_state
        assert_one_step_close(previous_state, ref_state, inner_state, "inner state")
        ref_state = previous_state = inner_state


def test_a_state_held_in_an_equinox_module_is_found():
    class TrainState(eqx.Module):
        model: eqx.nn.MLP
        opt_state: object
        name: str = eqx.field(static=True, default="run")

    tx = lossscale.wrap(optax.sgd(0.1), lossscale.DynamicLossScale(8.0))
    model = mlp()
    state = TrainState(model, tx.init(eqx.filter(model, eqx.is_inexact_array)))
    assert float(lossscale.get_loss_scale(state).scale) == 8.0
    assert float(lossscale.metrics(state)["loss_scale"]) == 8.0
    assert float(lossscale.scale_loss(jnp.float32(1.0), state)) == 8.0


def test_an_unfiltered_model_as_gradients_gets_a_clear_error():
    model = mlp()
    tx = lossscale.wrap(optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"activation has dtype None.*eqx.filter_grad"):
        tx.update(model, tx.init(model), model)
