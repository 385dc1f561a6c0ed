"""Diagnostics (`_src/api/metrics.py`): forward vs backward overflows
(`value=`), the stuck indicator and `metrics`, optax pitfalls, and `grad_stats`
against numpy.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import line_of
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import lossscale

PARAMS = {"w": jnp.array([1.0, -2.0, 3.0])}
FINITE = {"w": jnp.array([0.5, 0.5, 0.5])}
INF = {"w": jnp.array([0.5, jnp.inf, 0.5])}


def run(tx, steps):
    """Runs (grads, value) steps; returns the metrics after each, on the host."""
    update = jax.jit(tx.update)
    params, opt_state, history = PARAMS, tx.init(PARAMS), []
    for grads, value in steps:
        kwargs = {} if value is None else {"value": jnp.float32(value)}
        updates, opt_state = update(grads, opt_state, params, **kwargs)
        params = optax.apply_updates(params, updates)
        history.append(jax.tree.map(np.asarray, lossscale.metrics(opt_state)))
    return params, opt_state, history


def test_a_non_finite_loss_skips_without_backing_off():
    tx = lossscale.wrap(optax.sgd(0.1), lossscale.DynamicLossScale(1024.0))
    params, opt_state, history = run(tx, [(FINITE, np.inf), (INF, np.nan)])
    np.testing.assert_array_equal(params["w"], PARAMS["w"])
    assert [h["loss_scale"] for h in history] == [1024.0, 1024.0]
    assert [h["forward_overflows"] for h in history] == [1, 2]
    assert [h["backward_overflows"] for h in history] == [0, 0]
    assert history[-1]["skipped_steps"] == 2
    assert int(opt_state.loss_scale.counter) == 0


def test_a_finite_loss_with_non_finite_gradients_backs_off():
    tx = lossscale.wrap(optax.sgd(0.1), lossscale.DynamicLossScale(1024.0))
    _, _, history = run(tx, [(INF, 2.5), (FINITE, 2.5), (INF, None)])
    assert [h["loss_scale"] for h in history] == [512.0, 512.0, 256.0]
    assert [h["backward_overflows"] for h in history] == [1, 1, 2]
    assert [h["forward_overflows"] for h in history] == [0, 0, 0]
    assert [bool(h["last_finite"]) for h in history] == [False, True, False]


def test_forward_overflows_do_not_reset_growth_progress():
    # Growth after 3 finite steps; a forward overflow in between neither counts
    # nor resets the count (it says nothing about the scale).
    tx = lossscale.wrap(
        optax.sgd(0.1), lossscale.DynamicLossScale(8.0, growth_interval=3)
    )
    steps = [(FINITE, 1.0), (FINITE, np.inf), (FINITE, 1.0), (FINITE, 1.0)]
    _, _, history = run(tx, steps)
    assert [h["loss_scale"] for h in history] == [8.0, 8.0, 8.0, 16.0]


@pytest.mark.parametrize(
    "loss_scale, steps, stuck",
    [
        # Backing off from 2 to the minimum 1 is not stuck; overflowing at 1 is.
        (lossscale.DynamicLossScale(2.0), [INF, INF, FINITE, INF], [0, 1, 0, 1]),
        (lossscale.StaticLossScale(4.0), [FINITE, INF, INF], [0, 1, 1]),
        (None, [INF, FINITE], [1, 0]),
    ],
)
def test_stuck_when_overflowing_at_the_lowest_scale(loss_scale, steps, stuck):
    tx = lossscale.wrap(optax.sgd(0.1), loss_scale)
    _, _, history = run(tx, [(grads, 1.0) for grads in steps])
    assert [int(h["stuck"]) for h in history] == stuck


def test_forward_overflow_at_min_scale_is_not_stuck():
    tx = lossscale.wrap(optax.sgd(0.1), lossscale.DynamicLossScale(1.0))
    _, _, history = run(tx, [(INF, np.inf)])
    assert not history[0]["stuck"]


def test_a_training_loop_can_stop_cleanly_when_stuck():
    # Gradients that overflow at every scale: the loop sees `stuck` once the
    # scale has backed off to its minimum, after log2(2**15) = 15 back-offs.
    tx = lossscale.wrap(optax.adam(1e-3))
    update = jax.jit(tx.update)
    opt_state = tx.init(PARAMS)
    for step in range(100):  # noqa: B007 (read after the loop)
        _, opt_state = update(INF, opt_state, PARAMS, value=jnp.float32(1.0))
        if lossscale.metrics(opt_state)["stuck"]:
            break
    assert step == 15
    assert float(lossscale.get_loss_scale(opt_state).scale) == 1.0


def test_value_is_passed_on_to_the_inner_transformation():
    seen = []

    def update_fn(updates, state, params=None, *, value=None, **extra):
        seen.append(value)
        return updates, state

    inner = optax.GradientTransformationExtraArgs(
        lambda p: optax.EmptyState(), update_fn
    )
    tx = lossscale.wrap(inner, 1.0)
    tx.update(FINITE, tx.init(PARAMS), PARAMS, value=jnp.float32(3.0))
    # Traced twice: once for the output types of the skipped branch.
    assert seen and all(float(v) == 3.0 for v in seen)


@pytest.mark.parametrize(
    "value, error, match",
    [
        (jnp.ones(2), ValueError, "`value` must be a scalar"),
        (jnp.int32(1), TypeError, "`value` must be floating point"),
        ("1.0", TypeError, "`value` must be a floating-point scalar"),
    ],
)
def test_bad_values_are_refused(value, error, match):
    tx = lossscale.wrap(optax.sgd(0.1))
    with pytest.raises(error, match=match):
        tx.update(FINITE, tx.init(PARAMS), PARAMS, value=value)


def test_update_takes_loss_finite_and_checks_it():
    state = lossscale.update(
        lossscale.DynamicLossScale(4.0), jnp.array(False), jnp.array(False)
    )
    assert float(state.scale) == 4.0 and int(state.forward_overflows) == 1
    with pytest.raises(TypeError, match="loss_finite"):
        lossscale.update(state, jnp.array(True), jnp.float32(1.0))


# -- optax features around the wrap ---------------------------------------------


def test_adam_with_float16_parameters_and_the_eps_pitfall():
    # Adam's default eps (1e-8) is 0 in float16: a zero gradient gives 0 / 0.
    # Its updates are NaN although the gradients were finite, so no skip can
    # catch it. Keep float32 parameters, or use an eps float16 can hold.
    params = jnp.ones(3, jnp.float16)
    zero = jnp.zeros(3, jnp.float16)

    def updates_of(inner, params):
        tx = lossscale.wrap(inner)
        updates, _ = tx.update(zero.astype(params.dtype), tx.init(params), params)
        return np.asarray(updates)

    assert np.isnan(updates_of(optax.adam(1e-3), params)).all()
    assert np.isnan(updates_of(optax.adam(1e-3, mu_dtype=jnp.float32), params)).all()
    assert np.isfinite(updates_of(optax.adam(1e-3, eps=1e-4), params)).all()
    assert np.isfinite(updates_of(optax.adam(1e-3), params.astype(jnp.float32))).all()


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
    stats = jax.jit(lossscale.diagnostics.grad_stats)(
        tree, lossscale.StaticLossScale(scale)
    )
    assert_figures(stats, reference(leaves, scale))
    for i, leaf in enumerate(leaves):
        assert_figures(stats["leaves"][f"['leaf{i}']"], reference([leaf], scale))


def test_float16_and_bfloat16_leaves_and_non_finite_values():
    grads = {
        "h": jnp.array([0.0, 1.0, jnp.inf], jnp.float16),
        "b": jnp.array([jnp.nan, 2.0**-30], jnp.bfloat16),
    }
    stats = lossscale.diagnostics.grad_stats(grads)
    assert np.isnan(stats["max_abs"])  # NaN is never hidden
    assert float(stats["overflow_fraction"]) == np.float32(2 / 5)  # inf and NaN
    assert float(stats["underflow_fraction"]) == np.float32(1 / 5)  # 2**-30 < 2**-24
    assert float(stats["zero_fraction"]) == np.float32(1 / 5)
    assert float(stats["leaves"]["['h']"]["overflow_fraction"]) == np.float32(1 / 3)


def test_reads_the_scale_of_an_optimizer_state_and_has_no_host_transfer():
    import optax

    opt_state = lossscale.wrap(optax.sgd(0.1), 2.0**20).init(jnp.zeros(2))
    grads = jnp.array([0.05, 1e-3])  # 0.05 * 2**20 = 52428.8: fits, barely
    stats = lossscale.diagnostics.grad_stats(grads, opt_state)
    assert float(stats["overflow_fraction"]) == 0.0
    assert 0 < float(stats["headroom_bits"]) < 1
    text = (
        jax.jit(lossscale.diagnostics.grad_stats)
        .lower(grads, opt_state)
        .compile()
        .as_text()
    )
    assert "custom-call" not in text and "outfeed" not in text


def test_all_zero_and_empty_trees():
    stats = lossscale.diagnostics.grad_stats({"a": jnp.zeros(3)})
    assert float(stats["zero_fraction"]) == 1.0 and np.isinf(stats["headroom_bits"])
    assert float(lossscale.diagnostics.grad_stats({})["max_abs"]) == 0.0


def test_refuses_integer_leaves():
    with pytest.raises(TypeError, match=r"\['n'\]"):
        lossscale.diagnostics.grad_stats({"n": jnp.ones(2, jnp.int32)})


@pytest.mark.parametrize("loss_scale", ["dynamic", "static"])
def test_grad_stats_refuses_a_string_naming_what_it_takes(loss_scale):
    with pytest.raises(TypeError, match="the scale to evaluate at") as info:
        lossscale.diagnostics.grad_stats({"w": jnp.ones(2)}, loss_scale)
    assert "2.0**15" in str(info.value)


@pytest.mark.parametrize("loss_scale", [0, -2.0, np.inf, np.nan, np.float32(0.0)])
def test_grad_stats_refuses_a_scale_that_is_not_positive_and_finite(loss_scale):
    with pytest.raises(ValueError, match="must be positive and finite"):
        lossscale.diagnostics.grad_stats({"w": jnp.ones(2)}, loss_scale)


def test_grad_stats_takes_a_traced_scale_unchecked():
    # A traced scale cannot be read without a sync: it is taken as given.
    grads = {"w": jnp.array([1.0, 2.0])}
    headroom = jax.jit(
        lambda s: lossscale.diagnostics.grad_stats(grads, s)["headroom_bits"]
    )
    expected = np.log2(np.float32(65504.0) / (2.0 * 4.0))
    np.testing.assert_allclose(headroom(jnp.float32(4.0)), expected, rtol=1e-6)


# -- an equation the diagnostics do not know ----------------------------------------


def _unknown_square():
    """A primitive of the test's own, unknown to lossscale: `x * x`, differentiable."""
    from jax.extend import core
    from jax.interpreters import ad
    from jax.interpreters import mlir

    square_p = core.Primitive("lossscale_test_square")
    square_p.def_impl(lambda x: x * x)
    square_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(square_p, mlir.lower_fun(lambda x: x * x, False))
    ad.defjvp(square_p, lambda g, x: 2 * x * g)  # unknown-jvp-line
    return square_p


def test_an_unknown_equation_gets_findings_not_a_crash():
    square_p = _unknown_square()

    def loss_fn(w, x):
        h = x.astype(jnp.float16) * w.astype(jnp.float16)
        return jnp.sum(square_p.bind(h).astype(jnp.float32))  # unknown-op-line

    w, x = jnp.ones(4), jnp.arange(4.0)
    # Its backward overflows float16 at 2**15 (2 * 3 * 2**15): a warning at the
    # line that defines its derivative; the reference gradient is finite.
    report = lossscale.diagnostics.preflight(loss_fn, w, x)
    codes = [(f.code, f.where) for f in report.findings]
    assert ("gradient-overflow", line_of(__file__, "unknown-jvp-line")) in codes, report
    np.testing.assert_array_equal(jax.grad(loss_fn)(w, x), [0.0, 2.0, 8.0, 18.0])
    located = lossscale.diagnostics.locate_overflow(loss_fn, w, x, loss_scale=2.0**15)
    assert located.kind == "backward", located
    assert "The gradient is not finite." in str(located), located
    # 300**2 overflows float16 in the forward pass: the unknown op is named.
    big = x.at[0].set(300.0)
    (finding,) = lossscale.diagnostics.preflight(loss_fn, w, big).findings
    assert (finding.code, finding.where) == (
        "forward-overflow",
        line_of(__file__, "unknown-op-line"),
    ), finding
    assert "`lossscale_test_square`" in finding.message
    located = lossscale.diagnostics.locate_overflow(loss_fn, w, big, loss_scale=1.0)
    assert (located.kind, located.op) == ("forward", "lossscale_test_square"), located
