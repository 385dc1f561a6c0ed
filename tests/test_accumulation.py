"""Gradient accumulation: `wrap(MultiSteps(inner))`; `MultiSteps(wrap(inner))` refused.

Checked against a reference that runs the inner optimizer on the mean of the finite
micro-batch gradients, i.e. on the gradient of one large batch.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import scaled_loss_step

import lossscale

K = 4  # micro-batches per effective batch
MICRO = 16


def loss_fn(params, x, y):
    return jnp.mean((jnp.tanh(x @ params["w"]) + params["b"] - y) ** 2)


def init_params():
    return {"w": jax.random.normal(jax.random.key(0), (8, 4)) * 0.5, "b": jnp.zeros(4)}


def micro_batches(count, poison=()):
    keys = jax.random.split(jax.random.key(1), count)
    out = []
    for index, key in enumerate(keys):
        kx, ky = jax.random.split(key)
        x = jax.random.normal(kx, (MICRO, 8))
        if index in poison:
            x = x.at[0, 0].set(jnp.inf)
        out.append((x, jax.random.normal(ky, (MICRO, 4))))
    return out


def train(tx, batches):
    step = scaled_loss_step(tx, loss_fn)
    params, opt_state = init_params(), tx.init(init_params())
    scales = []
    for x, y in batches:
        params, opt_state = step(params, opt_state, x, y)
        scales.append(float(lossscale.get_loss_scale(opt_state).scale))
    return params, opt_state, scales


def reference(inner, groups):
    """The inner optimizer on the large batch made of each group of micro-batches."""
    params, state = init_params(), inner.init(init_params())
    for group in groups:
        x = jnp.concatenate([x for x, _ in group])
        y = jnp.concatenate([y for _, y in group])
        grads = jax.grad(loss_fn)(params, x, y)
        updates, state = inner.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


def assert_close(a, b):
    jax.tree.map(
        lambda u, v: np.testing.assert_allclose(u, v, rtol=2e-5, atol=1e-7), a, b
    )


@pytest.mark.parametrize("kind", [2.0**12, "dynamic", None])
def test_multisteps_around_wrap_is_refused_at_init_with_the_fix(kind):
    for tx in (
        optax.MultiSteps(lossscale.wrap(optax.adam(1e-2), kind), K),
        optax.MultiSteps(
            optax.chain(optax.clip(1.0), lossscale.wrap(optax.sgd(1.0))), K
        ),
        # Nested deeper than a frame walk of a few frames reaches.
        optax.MultiSteps(
            optax.chain(optax.chain(optax.chain(lossscale.wrap(optax.sgd(1.0))))), K
        ),
        optax.MultiSteps(
            optax.multi_transform(
                {"x": optax.chain(lossscale.wrap(optax.sgd(1.0)))},
                lambda params: jax.tree.map(lambda _: "x", params),
            ),
            K,
        ),
    ):
        with pytest.raises(
            ValueError, match=r"lossscale.wrap\(optax.MultiSteps\(inner, k"
        ):
            tx.init(init_params())


def test_wrap_around_multisteps_equals_one_large_batch():
    batches = micro_batches(3 * K)
    inner = optax.adam(1e-2)
    tx = lossscale.wrap(optax.MultiSteps(inner, K), lossscale.DynamicLossScale(2.0**12))
    params, _, _ = train(tx, batches)
    groups = [batches[i : i + K] for i in range(0, len(batches), K)]
    assert_close(params, reference(inner, groups))


def test_optax_multisteps_keeps_a_nan_for_good_which_is_why_it_is_refused_outside():
    # optax's MultiSteps (0.2.8) resets its accumulators as `(1 - emit) * acc`,
    # and 0 * NaN is NaN: after one non-finite micro-batch every later cycle's
    # mean is NaN, so a wrap inside it would skip them all while the scale
    # collapsed. If this test fails, optax has fixed the reset: the refusal of
    # `MultiSteps(wrap(...))` (and the accumulation guide) can be reconsidered.
    tx = optax.MultiSteps(optax.sgd(1.0), K)
    params = init_params()
    state = tx.init(params)
    grads = jax.grad(loss_fn)(params, *micro_batches(1)[0])
    bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads)
    for index in range(3 * K):
        given = bad if index == 1 else grads
        _, state = jax.jit(tx.update)(given, state, params)
    assert not all(
        bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(state.acc_grads)
    )


def test_wrap_around_multisteps_drops_only_the_bad_micro_batch():
    # Here each micro-batch is checked and unscaled on its own: the bad one is
    # dropped, the scale backs off right away, and the cycle completes with the
    # next micro-batch. Growth intervals count micro-batches.
    batches = micro_batches(3 * K + 1, poison={5})
    inner = optax.adam(1e-2)
    tx = lossscale.wrap(optax.MultiSteps(inner, K), lossscale.DynamicLossScale(2.0**12))
    params, opt_state, scales = train(tx, batches)
    assert scales == [2.0**12] * 5 + [2.0**11] * 8
    good = [b for i, b in enumerate(batches) if i != 5]
    groups = [good[i : i + K] for i in range(0, len(good), K)]
    assert int(opt_state.inner_state.inner_opt_state[0].count) == 3
    acc_grads = opt_state.inner_state.acc_grads
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(acc_grads))
    assert_close(params, reference(inner, groups))
