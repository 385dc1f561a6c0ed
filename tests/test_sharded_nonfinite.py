"""A NaN or an inf in one shard of a gradient, under sharded `jit` on eight devices.

A sharded reduction is a reduction per device, then a collective over the devices'
results; XLA:CPU's all-reduce of a `max` or a `min` drops a NaN (`jnp.max` of a
sharded float16 array with one NaN gives 1.0), so the check must not rest on one.
Each entry point is tried in each backend's form, with the bad element in one
shard only, the array split over its rows or its columns.
"""

import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import DEVICES
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lossscale
import lossscale.flax

pytestmark = pytest.mark.skipif(len(DEVICES) < 8, reason="needs 8 CPU devices")

SPECS = {"rows": P("data", None), "columns": P(None, "data")}
# (27, 100) lies on device 3 of 8 both ways: rows 24..31, columns 96..127 of 256.
WHERE = (27, 100)
# 16384 elements: reduced alone in XLA:CPU's form; 2048: stacked with others.
SHAPES = {"large": (64, 256), "small": (16, 128)}
DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32]
BAD = [np.nan, -np.nan, np.inf, -np.inf]


def placed(tree, mesh, specs):
    """`tree` on `mesh`, each leaf split as `specs` (a tree of its own) says."""
    return jax.tree.map(
        lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), tree, specs
    )


def gradients(dtype, shape, bad=None, where=WHERE):
    rng = np.random.default_rng(0)
    g = rng.uniform(0.5, 1.0, shape).astype(np.float32)
    if bad is not None:
        g[where[0] % shape[0], where[1] % shape[1]] = bad
    return {"w": jnp.asarray(g, dtype), "b": jnp.ones((shape[1],), dtype)}


def shard_of(array, index):
    """The devices holding `array[index]`: one, for a sharded array."""
    return [
        shard.device
        for shard in array.addressable_shards
        if all(
            (s.start or 0) <= i < (s.stop if s.stop is not None else n)
            for s, i, n in zip(shard.index, index, array.shape, strict=True)
        )
    ]


@pytest.mark.parametrize("size", SHAPES)
@pytest.mark.parametrize("layout", SPECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_all_finite_sees_a_bad_element_in_one_shard(
    mesh, dtype, layout, size, backend_form
):
    shape = SHAPES[size]
    # A function of this test's own: jit's cache, keyed by the function, would
    # give another form's trace of `lossscale.all_finite` itself.
    check = jax.jit(lambda tree: lossscale.all_finite(tree))
    good = placed(gradients(dtype, shape), mesh, {"w": SPECS[layout], "b": P()})
    assert bool(check(good))
    for bad in BAD:
        grads = placed(
            gradients(dtype, shape, bad), mesh, {"w": SPECS[layout], "b": P()}
        )
        where = (WHERE[0] % shape[0], WHERE[1] % shape[1])
        assert len(shard_of(grads["w"], where)) == 1, "not in one shard only"
        assert not bool(check(grads)), f"{bad} in one shard of {layout} not seen"


def adam_step_inputs(mesh, dtype, layout, bad):
    spec = {"w": SPECS[layout], "b": P()}
    params = placed(
        {"w": jnp.zeros(SHAPES["large"]), "b": jnp.zeros(SHAPES["large"][1])},
        mesh,
        spec,
    )
    grads = placed(gradients(dtype, SHAPES["large"], bad), mesh, spec)
    return params, grads


def assert_skipped(new_params, params, skipped_steps, bad):
    assert int(skipped_steps) == 1, f"{bad} in one shard: step not skipped"
    for new, old in zip(
        jax.tree.leaves(new_params), jax.tree.leaves(params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(new), np.asarray(old))


@pytest.mark.parametrize("layout", SPECS)
@pytest.mark.parametrize("dtype", DTYPES[:2], ids=lambda d: jnp.dtype(d).name)
def test_the_step_skips_a_bad_element_in_one_shard(mesh, dtype, layout, backend_form):
    tx = optax.adam(1e-3)
    wrapped = lossscale.wrap(tx, lossscale.DynamicLossScale(1.0))

    @jax.jit
    def with_wrap(params, grads):
        state = wrapped.init(params)
        updates, state = wrapped.update(grads, state, params)
        return optax.apply_updates(params, updates), state.loss_scale.skipped_steps

    @jax.jit
    def with_apply_gradients(params, grads):
        params, _, loss_scale = lossscale.apply_gradients(
            tx,
            grads=grads,
            params=params,
            opt_state=tx.init(params),
            loss_scale=lossscale.DynamicLossScale(1.0),
        )
        return params, loss_scale.skipped_steps

    @jax.jit
    def with_train_state(params, grads):
        state = lossscale.flax.TrainState.create(
            apply_fn=nn.Dense(1).apply,
            params=params,
            tx=tx,
            loss_scale=lossscale.DynamicLossScale(1.0),
        )
        state = state.apply_gradients(grads=grads)
        return state.params, state.loss_scale.skipped_steps

    clipped = lossscale.wrap(tx, lossscale.DynamicLossScale(1.0), clip_norm=1.0)

    @jax.jit
    def with_clip_norm(params, grads):  # the check is a sum of squares
        updates, state = clipped.update(grads, clipped.init(params), params)
        return optax.apply_updates(params, updates), state.loss_scale.skipped_steps

    for step in (with_wrap, with_apply_gradients, with_train_state, with_clip_norm):
        params, grads = adam_step_inputs(mesh, dtype, layout, None)
        new_params, skipped = step(params, grads)
        assert int(skipped) == 0 and np.all(np.isfinite(new_params["w"]))
        for bad in (np.nan, np.inf):
            params, grads = adam_step_inputs(mesh, dtype, layout, bad)
            new_params, skipped = step(params, grads)
            assert_skipped(new_params, params, skipped, f"{step.__name__}: {bad}")


def nan_in_one_row(params, x):
    h = x.astype(jnp.float16) @ params["w"].astype(jnp.float16)
    # inf where h > 11: in the one row of x that is 10, then NaN.
    e = jnp.exp(h)  # exp-line
    return jnp.mean((e - e + h).astype(jnp.float32) ** 2)


def test_preflight_traces_a_nan_in_one_shard_of_the_batch_to_its_line(mesh):
    params = {"w": jnp.full((16, 16), 0.1)}
    x = jnp.ones((64, 16)).at[27].set(10.0)  # row 27: device 3's
    replicated = lossscale.diagnostics.preflight(nan_in_one_row, params, x)
    sharded = lossscale.diagnostics.preflight(
        nan_in_one_row, params, jax.device_put(x, NamedSharding(mesh, P("data")))
    )
    line = helpers.line_of(__file__, "exp-line")
    for report in (replicated, sharded):
        assert report.codes == {"forward-overflow"}, str(report)
        assert [f.where for f in report.findings] == [line], str(report)
    # The reference: the loss is NaN, from that row only.
    assert np.isnan(float(nan_in_one_row(params, x)))
    assert np.isfinite(float(nan_in_one_row(params, x.at[27].set(1.0))))


@pytest.mark.parametrize("layout", SPECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_grad_stats_max_abs_is_nan_for_a_nan_anywhere(mesh, dtype, layout):
    stats = jax.jit(lambda tree: lossscale.diagnostics.grad_stats(tree))
    clean = gradients(dtype, SHAPES["large"])
    for bad in (np.nan, -np.nan):
        grads = gradients(dtype, SHAPES["large"], bad)
        sharded = placed(grads, mesh, {"w": SPECS[layout], "b": P()})
        for tree in (grads, sharded):
            figures = stats(tree)
            assert np.isnan(figures["max_abs"]), figures["max_abs"]
            assert np.isnan(figures["leaves"]["['w']"]["max_abs"])
            assert figures["leaves"]["['b']"]["max_abs"] == 1.0
    # inf, and a finite tree: the largest magnitude itself.
    inf = gradients(dtype, SHAPES["large"], -np.inf)
    inf = stats(placed(inf, mesh, {"w": SPECS[layout], "b": P()}))
    assert inf["max_abs"] == np.inf
    figures = stats(clean)["leaves"]["['w']"]
    assert float(figures["max_abs"]) == np.max(np.asarray(clean["w"], np.float32))
