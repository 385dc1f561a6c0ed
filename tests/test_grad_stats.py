"""`grad_stats` against a numpy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import lossscale

TINY = float(np.finfo(np.float16).smallest_subnormal)


def reference(leaves, scale):
    """Float64 numpy: each figure from its definition."""
    values = np.concatenate([np.abs(np.asarray(x, np.float64)).ravel() for x in leaves])
    scaled = values * np.float64(np.float32(scale))
    size = max(values.size, 1)
    max_abs = values.max() if values.size else 0.0
    return {
        "max_abs": max_abs,
        "zero_fraction": np.sum(values == 0) / size,
        "underflow_fraction": np.sum((values != 0) & (scaled < TINY)) / size,
        "overflow_fraction": np.sum(~(scaled < 65520.0)) / size,
        "headroom_bits": np.log2(65504.0 / (max_abs * np.float32(scale)))
        if max_abs
        else np.inf,
    }


def assert_figures(got, want):
    for key, value in want.items():
        np.testing.assert_allclose(float(got[key]), value, rtol=1e-5, err_msg=key)


# Magnitudes spread over float16's range and beyond, zeros included.
MAGNITUDES = st.one_of(
    st.just(0.0),
    st.floats(1e-12, 1e6, allow_nan=False).map(lambda x: float(np.float32(x))),
)
ARRAYS = hnp.arrays(
    np.float32, hnp.array_shapes(max_dims=2, max_side=6), elements=MAGNITUDES
)


@given(
    leaves=st.lists(ARRAYS, min_size=1, max_size=4),
    signs=st.integers(0, 2**16),
    scale=st.sampled_from([1.0, 2.0**-3, 1024.0, 2.0**15, 3.0]),
)
def test_matches_numpy(leaves, signs, scale):
    leaves = [
        x * np.where((np.arange(x.size) + signs) % 3 == 0, -1, 1).reshape(x.shape)
        for x in leaves
    ]
    tree = {f"leaf{i}": jnp.asarray(x) for i, x in enumerate(leaves)}
    stats = jax.jit(lossscale.grad_stats)(tree, lossscale.StaticLossScale(scale))
    assert_figures(stats, reference(leaves, scale))
    for i, leaf in enumerate(leaves):
        assert_figures(stats["leaves"][f"['leaf{i}']"], reference([leaf], scale))


def test_float16_and_bfloat16_leaves_and_non_finite_values():
    grads = {
        "h": jnp.array([0.0, 1.0, jnp.inf], jnp.float16),
        "b": jnp.array([jnp.nan, 2.0**-30], jnp.bfloat16),
    }
    stats = lossscale.grad_stats(grads)
    assert np.isnan(stats["max_abs"])  # NaN is never hidden
    assert float(stats["overflow_fraction"]) == np.float32(2 / 5)  # inf and NaN
    assert float(stats["underflow_fraction"]) == np.float32(1 / 5)  # 2**-30 < 2**-24
    assert float(stats["zero_fraction"]) == np.float32(1 / 5)
    assert float(stats["leaves"]["['h']"]["overflow_fraction"]) == np.float32(1 / 3)


def test_reads_the_scale_of_an_optimizer_state_and_has_no_host_transfer():
    import optax

    opt_state = lossscale.wrap(optax.sgd(0.1), 2.0**20).init(jnp.zeros(2))
    grads = jnp.array([0.05, 1e-3])  # 0.05 * 2**20 = 52428.8: fits, barely
    stats = lossscale.grad_stats(grads, opt_state)
    assert float(stats["overflow_fraction"]) == 0.0
    assert 0 < float(stats["headroom_bits"]) < 1
    text = jax.jit(lossscale.grad_stats).lower(grads, opt_state).compile().as_text()
    assert "custom-call" not in text and "outfeed" not in text


def test_all_zero_and_empty_trees():
    stats = lossscale.grad_stats({"a": jnp.zeros(3)})
    assert float(stats["zero_fraction"]) == 1.0 and np.isinf(stats["headroom_bits"])
    assert float(lossscale.grad_stats({})["max_abs"]) == 0.0


def test_refuses_integer_leaves():
    with pytest.raises(TypeError, match=r"\['n'\]"):
        lossscale.grad_stats({"n": jnp.ones(2, jnp.int32)})
