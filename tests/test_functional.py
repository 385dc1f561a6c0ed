"""The functional API (`_src/api/functional.py`): scale_loss, unscale_grads and
all_finite, against numpy."""

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given

import lossscale

pytestmark = pytest.mark.usefixtures("strict_promotion")

FLOAT_DTYPES = [np.float32, np.float16, jnp.bfloat16]


# -- scale_loss --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_scale_loss_promotes_to_float32_and_cannot_overflow(dtype):
    # Near float16's maximum: scaled in float16 it would be inf.
    loss = jnp.asarray(60000.0, dtype)
    scaled = jax.jit(lossscale.scale_loss)(loss, lossscale.DynamicLossScale())
    assert scaled.dtype == jnp.float32
    expected = np.float32(np.asarray(loss, np.float32)) * np.float32(2.0**15)
    assert np.asarray(scaled) == expected
    assert np.isfinite(np.asarray(scaled))


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (lossscale.NoOpLossScale(), 1.0),
        (lossscale.StaticLossScale(4), 4.0),
        (lossscale.StaticLossScale(0.5), 0.5),
        (lossscale.DynamicLossScale(), 2.0**15),
        (lossscale.DynamicLossScale(scale=8.0), 8.0),
    ],
)
def test_scale_loss_takes_every_kind_of_state(state, expected):
    assert float(lossscale.scale_loss(jnp.float32(1.5), state)) == 1.5 * expected


def test_scale_loss_of_a_function_returns_a_function_as_tf_does():
    # TF's `get_scaled_loss(loss)` takes a callable of no arguments as well.
    loss_scale = lossscale.StaticLossScale(8)
    scaled = lossscale.scale_loss(lambda: jnp.float16(1.5), loss_scale)
    assert callable(scaled)
    assert scaled().dtype == jnp.float32 and float(scaled()) == 12.0
    grad = jax.grad(lambda w: lossscale.scale_loss(lambda: w**2, loss_scale)())(3.0)
    assert float(grad) == 8 * 2 * 3.0
    with pytest.raises(TypeError, match="function of no arguments"):
        lossscale.scale_loss(lambda x: x, loss_scale)


SPECS = [None, 4, 0.5, "dynamic", np.float32(2.0), jnp.float32(2.0)]
PER_STEP_CALLS = {
    "scale_loss": lambda spec: lossscale.scale_loss(jnp.float32(1.0), spec),
    "unscale_grads": lambda spec: lossscale.unscale_grads({"w": jnp.ones(2)}, spec),
    "value_and_grad": lambda spec: lossscale.value_and_grad(jnp.sum)(spec, jnp.ones(2)),
    "check_config": lambda spec: lossscale.checkpoints.check_config(
        {"kind": "none"}, spec
    ),
}


@pytest.mark.parametrize("call", sorted(PER_STEP_CALLS))
@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_per_step_functions_refuse_specs_and_say_what_to_pass(call, spec):
    with pytest.raises(TypeError, match="describes a loss scale to create") as info:
        PER_STEP_CALLS[call](spec)
    assert "StaticLossScale" in str(info.value)


def test_the_issue_example_no_longer_steps_with_a_fresh_scale():
    # A wrapped optimizer backs off to 2**14; a fresh "dynamic" spec in the loss
    # would have scaled by 2**15 and doubled the step. Now it is an error.
    tx = lossscale.wrap(optax.sgd(1.0), "dynamic")
    p = jnp.array(1.0)
    s = tx.init(p)
    g = jax.grad(lambda p: lossscale.scale_loss(p * jnp.inf, s))(p)
    _, s = tx.update(g, s, p)
    with pytest.raises(TypeError, match="describes a loss scale to create"):
        jax.grad(lambda p: lossscale.scale_loss(p**2 / 2, "dynamic"))(p)
    g = jax.grad(lambda p: lossscale.scale_loss(p**2 / 2, s))(p)
    u, s = tx.update(g, s, p)
    assert float(u) == -1.0


def test_scale_loss_accepts_an_optimizer_state_holding_a_loss_scale():
    tx = optax.chain(optax.clip(1.0), lossscale.wrap(optax.sgd(0.1), 64.0))
    opt_state = tx.init(jnp.zeros(2))
    assert float(lossscale.scale_loss(jnp.float32(2.0), opt_state)) == 128.0


def test_gradient_of_scaled_loss_is_scaled_gradient():
    def loss(w):
        return jnp.sum(jnp.sin(w) * w)

    w = jnp.linspace(-2.0, 2.0, 7)
    grads = jax.grad(
        lambda w: lossscale.scale_loss(loss(w), lossscale.StaticLossScale(1024))
    )(w)
    np.testing.assert_array_equal(grads, jax.grad(loss)(w) * 1024)


@pytest.mark.parametrize(
    ("loss", "error", "message"),
    [
        (jnp.ones(3), ValueError, r"scalar, got shape \(3,\).*jnp.mean"),
        (jnp.int32(3), TypeError, "floating point, got dtype int32"),
        (jnp.asarray(True), TypeError, "floating point"),
        ("1.0", TypeError, "floating-point scalar"),
        (3, TypeError, "floating-point scalar"),
    ],
)
def test_scale_loss_rejects_bad_losses(loss, error, message):
    with pytest.raises(error, match=message):
        lossscale.scale_loss(loss, lossscale.StaticLossScale(2.0))


@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        ("static", TypeError, "loss-scale state"),
        (True, TypeError, "loss_scale"),
        ({"not": "an optimizer state"}, ValueError, "No loss-scale state found"),
        ([1.0, 2.0], ValueError, "No loss-scale state found in `loss_scale`"),
    ],
)
def test_scale_loss_rejects_bad_loss_scales(spec, error, message):
    with pytest.raises(error, match=message):
        lossscale.scale_loss(jnp.float32(1.0), spec)


# -- unscale_grads -----------------------------------------------------------------


def numpy_unscale(grad, scale):
    grad = np.asarray(grad)
    inverse = np.float32(1.0) / np.float32(scale)
    return (grad.astype(np.float32) * inverse).astype(grad.dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("scale", [2.0**15, 3.0, 0.5, 1000.0])
def test_unscale_grads_matches_numpy_and_keeps_dtype(dtype, scale):
    rng = np.random.default_rng(0)
    grad = (rng.standard_normal(257) * 100).astype(dtype)
    state = lossscale.StaticLossScale(scale)
    out = jax.jit(lambda g: lossscale.unscale_grads(g, state))({"g": grad})["g"]
    assert out.dtype == grad.dtype
    np.testing.assert_array_equal(np.asarray(out), numpy_unscale(grad, scale))


def test_unscale_grads_is_exact_division_for_power_of_two_scales():
    grad = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    out = lossscale.unscale_grads(jnp.asarray(grad), lossscale.DynamicLossScale())
    np.testing.assert_array_equal(np.asarray(out), grad / np.float32(2.0**15))


def test_unscale_grads_passes_none_leaves_and_keeps_structure():
    grads = {"a": jnp.full([2], 8.0), "frozen": None, "nested": (jnp.float16(4.0),)}
    out = lossscale.unscale_grads(grads, lossscale.StaticLossScale(4.0))
    assert jax.tree.structure(out, is_leaf=lambda x: x is None) == jax.tree.structure(
        grads, is_leaf=lambda x: x is None
    )
    assert out["frozen"] is None
    np.testing.assert_array_equal(out["a"], [2.0, 2.0])
    assert out["nested"][0].dtype == jnp.float16 and float(out["nested"][0]) == 1.0


def test_unscale_grads_with_noop_is_identity():
    grads = {"a": jnp.arange(3.0)}
    assert lossscale.unscale_grads(grads, lossscale.NoOpLossScale())["a"] is grads["a"]


def test_unscale_grads_rejects_integer_gradients_naming_the_leaf():
    with pytest.raises(TypeError, match=r"\['count'\].*int32"):
        lossscale.unscale_grads(
            {"w": jnp.ones(2), "count": jnp.ones(2, jnp.int32)},
            lossscale.StaticLossScale(2),
        )


def test_float16_gradients_that_underflow_at_scale_1_are_recovered_with_scaling():
    # The mean over a large batch: the loss's cotangent, 1/n, times small float16
    # activations falls below float16's smallest subnormal (5.96e-8) unscaled.
    n = 4096
    x = jnp.asarray(np.random.default_rng(0).uniform(1e-5, 5e-5, n), jnp.float16)
    w = jnp.ones(n, jnp.float32)  # float32 master weights, float16 compute

    def loss(w):
        return jnp.mean(w.astype(jnp.float16) * x)

    def grads_with(loss_scale):
        grads = jax.grad(lambda w: lossscale.scale_loss(loss(w), loss_scale))(w)
        return lossscale.unscale_grads(grads, loss_scale)

    exact = np.asarray(x, np.float64) / n  # the true gradient, 2.4e-9 to 1.2e-8
    unscaled = grads_with(lossscale.NoOpLossScale())
    scaled = grads_with(lossscale.DynamicLossScale())
    assert np.count_nonzero(np.asarray(unscaled)) == 0  # every element underflowed
    relative_error = np.abs(np.asarray(scaled, np.float64) - exact) / exact
    assert relative_error.max() < 2e-3  # float16's own precision, nothing lost


# -- all_finite --------------------------------------------------------------------


@st.composite
def arrays_with_specials(draw):
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, max_side=9))
    values = draw(
        hnp.arrays(
            np.float32,
            shape,
            elements=st.one_of(
                st.floats(-1e4, 1e4, width=32),
                st.sampled_from([np.inf, -np.inf, np.nan, 0.0, -0.0, 65504.0]),
            ),
        )
    )
    return values.astype(dtype)


jitted_all_finite = jax.jit(lossscale.all_finite)


@given(st.lists(arrays_with_specials(), min_size=0, max_size=4))
def test_all_finite_matches_numpy(leaves):
    expected = all(np.isfinite(leaf.astype(np.float32)).all() for leaf in leaves)
    tree = [jnp.asarray(leaf) for leaf in leaves]
    assert bool(jitted_all_finite(tree)) == expected


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_all_finite_finds_one_bad_element_in_a_large_leaf(dtype, bad):
    leaf = jnp.ones((300, 301), dtype).at[299, 300].set(bad)
    assert not bool(jitted_all_finite({"ok": jnp.ones(5), "bad": leaf}))
    # Large finite values must not overflow the reduction.
    big = jnp.full((300, 301), jnp.finfo(dtype).max, dtype)
    assert bool(jitted_all_finite({"big": big, "negative": -big}))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("size", [4097, 90_601, 1_000_003])
def test_16_bit_checks_see_nan_anywhere_in_large_leaves(dtype, size):
    # Large 16-bit leaves are checked with an `or` (float16) or a widened sum
    # (bfloat16) on XLA:CPU; NaN, -NaN, inf and -inf anywhere must show.
    leaf = jnp.ones(size, dtype)
    for position in [0, 1, size // 2, size - 2, size - 1]:
        for bad in [np.nan, -np.nan, np.inf, -np.inf]:
            assert not bool(jitted_all_finite([leaf.at[position].set(bad)]))
    assert bool(jitted_all_finite([leaf]))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(4, 6), (3, 5)], ids=["even", "odd"])
def test_small_16_bit_leaves_show_a_bad_element_at_every_position(
    dtype, shape, backend_form
):
    # Small leaves are stacked (XLA:CPU's and XLA:GPU's forms): an inf or a NaN at
    # any position of one leaf of the stack must show, and the finite extremes
    # around it must not hide or fake one.
    check = jax.jit(lambda tree: lossscale.all_finite(tree))
    finfo = jnp.finfo(dtype)
    edges = [finfo.max, -finfo.max, finfo.smallest_subnormal, -0.0, 0.0, 1.0]
    leaf = np.resize(np.asarray(edges, np.float32), shape).astype(dtype)
    assert bool(check([jnp.asarray(leaf)] * 3))
    for position in range(leaf.size):
        for bad in (np.nan, -np.inf):
            poisoned = leaf.copy()
            poisoned.flat[position] = bad
            tree = [jnp.asarray(leaf), jnp.asarray(poisoned), jnp.asarray(leaf)]
            assert not bool(check(tree)), (position, bad)


def test_all_finite_ignores_integer_and_none_leaves():
    tree = {"i": jnp.arange(3), "n": None, "b": jnp.array([True]), "f": jnp.ones(2)}
    assert bool(lossscale.all_finite(tree))
    assert bool(lossscale.all_finite({}))


def test_all_finite_returns_a_boolean_scalar():
    out = lossscale.all_finite({"a": jnp.ones(3)})
    assert out.shape == () and out.dtype == jnp.bool_


# -- the arguments in the wrong order ------------------------------------------------


def test_scale_loss_with_its_arguments_swapped_says_so():
    state = lossscale.StaticLossScale(4.0)
    with pytest.raises(TypeError, match=r"`scale_loss\(loss, loss_scale\)`.*Swap"):
        lossscale.scale_loss(state, jnp.float32(1.0))
    opt_state = lossscale.wrap(optax.sgd(0.1), 4.0).init(jnp.ones(2))
    with pytest.raises(TypeError, match=r"at \.loss_scale"):
        lossscale.scale_loss(opt_state, jnp.float32(1.0))


def test_unscale_grads_with_its_arguments_swapped_says_so():
    opt_state = lossscale.wrap(optax.sgd(0.1), 4.0).init({"w": jnp.ones(2)})
    with pytest.raises(TypeError, match=r"`unscale_grads\(grads, loss_scale\)`"):
        lossscale.unscale_grads(opt_state, {"w": jnp.ones(2)})
