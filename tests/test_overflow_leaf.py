"""`metrics(...)["overflow_leaf"]`: where the latest skipped step overflowed."""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import examples
from hypothesis import given
from hypothesis import settings
from jax.sharding import PartitionSpec as P

import lossscale
import lossscale.flax
from lossscale._src.step import finite
from lossscale._src.step import forms
from lossscale._src.step import unscaling


def reference_first_nonfinite(leaves):
    """The pure-numpy answer: the position in `jax.tree.leaves` (None leaves
    dropped, as there) of the first leaf with a non-finite value."""
    present = [leaf for leaf in leaves if leaf is not None]
    for position, leaf in enumerate(present):
        if not np.isfinite(np.asarray(leaf, np.float64)).all():
            return position
    return -1


# Small leaves are stacked by shape and dtype (one flag per leaf), large ones reduced
# alone: the trees mix both, and float16 with float32.
SHAPES = [(3,), (3,), (2, 2), (forms.GROUP_BELOW,), (70, 60)]


@st.composite
def trees(draw):
    count = draw(st.integers(1, 7))
    leaves = []
    for _ in range(count):
        if draw(st.booleans()) and draw(st.booleans()):
            leaves.append(None)  # Equinox's gradient of a function leaf
            continue
        shape = draw(st.sampled_from(SHAPES))
        dtype = draw(st.sampled_from([np.float32, np.float16]))
        leaf = np.ones(shape, dtype)
        bad = draw(st.sampled_from([None, np.inf, -np.inf, np.nan]))
        if bad is not None:
            leaf.reshape(-1)[draw(st.integers(0, leaf.size - 1))] = bad
        leaves.append(leaf)
    return leaves


@settings(max_examples=examples(25))  # a compile each
@given(trees())
def test_the_index_is_the_first_non_finite_leaf_as_numpy_finds_it(leaves):
    grads = {f"g{i:02d}": leaf for i, leaf in enumerate(leaves)}

    def first(grads, state):
        return finite.check(unscaling.values_to_check(grads, state), state).first

    index = jax.jit(first)(grads, lossscale.StaticLossScale(1.0))
    assert int(index) == reference_first_nonfinite(leaves)


def params_and_grads(bad_leaf=None):
    params = {
        "embed": jnp.ones((5000,)),  # large: reduced alone
        "layers": [{"b": jnp.ones(4), "w": jnp.ones((4, 4))} for _ in range(3)],
    }
    grads = jax.tree.map(lambda p: 0.5 * p, params)
    if bad_leaf is not None:
        leaves, treedef = jax.tree.flatten(grads)
        leaves[bad_leaf] = leaves[bad_leaf].at[0].set(jnp.inf)
        grads = jax.tree.unflatten(treedef, leaves)
    return params, grads


def test_wrap_records_the_latest_overflow_and_keeps_it_on_applied_steps():
    params, _ = params_and_grads()
    tx = lossscale.wrap(optax.adam(1e-3), 8.0)
    step = jax.jit(tx.update)
    opt_state = tx.init(params)
    assert int(lossscale.metrics(opt_state)["overflow_leaf"]) == -1  # before any
    history = []
    for bad in [None, 4, None, 0, 6, None]:
        _, grads = params_and_grads(bad)
        _, opt_state = step(grads, opt_state, params)
        history.append(int(lossscale.metrics(opt_state)["overflow_leaf"]))
    assert history == [-1, 4, 4, 0, 6, 6]
    assert lossscale.diagnostics.leaf_path(params, history[1]) == "['layers'][1]['w']"
    assert lossscale.diagnostics.leaf_path(params, history[3]) == "['embed']"


def test_the_index_counts_leaves_in_the_parameters_order_with_their_paths():
    params, _ = params_and_grads()
    paths = [
        jax.tree_util.keystr(path)
        for path, _ in jax.tree_util.tree_leaves_with_path(params)
    ]
    tx = lossscale.wrap(optax.sgd(0.1))
    for bad in range(len(paths)):
        _, grads = params_and_grads(bad)
        _, opt_state = tx.update(grads, tx.init(params), params)
        index = lossscale.metrics(opt_state)["overflow_leaf"]
        assert lossscale.diagnostics.leaf_path(params, index) == paths[bad]


def apply_gradients_overflow_leaf(bad_leaf, clip_norm=None):
    params, grads = params_and_grads(bad_leaf)
    _, _, loss_scale = lossscale.apply_gradients(
        optax.sgd(0.1),
        grads=grads,
        params=params,
        opt_state=optax.sgd(0.1).init(params),
        loss_scale=lossscale.StaticLossScale(4.0),
        clip_norm=clip_norm,
    )
    return int(loss_scale.overflow_leaf)


@pytest.mark.parametrize("clip_norm", [None, 1.0])
def test_with_clip_norm_the_leaf_is_found_too(clip_norm):
    # With `clip_norm` the norm is the check: the skip branch finds the leaf.
    assert apply_gradients_overflow_leaf(3, clip_norm) == 3


# Leaves the XLA:GPU form once ordered otherwise: a small leaf before a large one
# (large leaves came first), and small leaves of interleaved shapes (grouped by
# shape). Each form must name the first non-finite leaf in tree order.
TREE_ORDER_CASES = {
    "small before large": [(3,), (forms.GROUP_BELOW,)],
    "interleaved shapes": [(3,), (4,), (3,), (4,)],
}


@pytest.mark.parametrize("shapes", TREE_ORDER_CASES.values(), ids=TREE_ORDER_CASES)
def test_every_form_names_the_first_non_finite_leaf_in_tree_order(backend_form, shapes):
    tx = optax.sgd(0.1)
    step = jax.jit(functools.partial(lossscale.apply_gradients, tx))
    for bad in range(len(shapes) - 1):
        leaves = [np.ones(shape, np.float32) for shape in shapes]
        for later in range(bad, len(shapes)):  # this leaf and every later one
            leaves[later][-1] = np.inf
        grads = {f"g{i}": leaf for i, leaf in enumerate(leaves)}
        params = jax.tree.map(jnp.zeros_like, grads)
        _, _, state = step(
            grads=grads,
            params=params,
            opt_state=tx.init(params),
            loss_scale=lossscale.DynamicLossScale(),
        )
        expected = reference_first_nonfinite(leaves)
        assert expected == bad
        assert int(state.overflow_leaf) == expected, (backend_form, shapes, bad)


# Finite gradients whose sum of squares overflows float32: one leaf's own sum (8
# rows of 1024 squares of 3e17, each row's sum finite), or only the sum over two
# leaves (each 4 squares of 7e18).
NORM_OVERFLOWS = {
    "in one leaf": ([np.full((8, 1024), 3e17, np.float32)], 0),
    "over the leaves": ([np.full(4, 7e18, np.float32)] * 2, -1),
}


@pytest.mark.parametrize(
    "leaves, expected", NORM_OVERFLOWS.values(), ids=NORM_OVERFLOWS
)
def test_with_clip_norm_an_overflowing_norm_is_recorded_alike_by_every_form(
    backend_form, leaves, expected
):
    # `overflow_leaf` is then the first leaf whose own sum of squares is not
    # finite, -1 if only the sum over leaves overflows: the same in every form.
    grads = {f"g{i}": jnp.asarray(leaf) for i, leaf in enumerate(leaves)}
    assert all(np.isfinite(leaf).all() for leaf in leaves)
    squares = sum(np.sum(leaf.astype(np.float64) ** 2) for leaf in leaves)
    assert squares > np.finfo(np.float32).max
    tx = optax.sgd(0.1)
    params = jax.tree.map(jnp.zeros_like, grads)
    _, _, state = jax.jit(
        functools.partial(lossscale.apply_gradients, tx, clip_norm=1.0)
    )(
        grads=grads,
        params=params,
        opt_state=tx.init(params),
        loss_scale=lossscale.NoOpLossScale(),
    )
    assert int(state.skipped_steps) == 1
    assert int(state.overflow_leaf) == expected, (
        backend_form,
        int(state.overflow_leaf),
    )


def test_a_forward_overflow_with_finite_gradients_records_no_leaf():
    params, grads = params_and_grads()
    tx = lossscale.wrap(optax.sgd(0.1))
    _, opt_state = tx.update(grads, tx.init(params), params, value=jnp.inf)
    metrics = lossscale.metrics(opt_state)
    assert int(metrics["forward_overflows"]) == 1
    assert int(metrics["overflow_leaf"]) == -1


def test_below_a_scale_of_one_the_leaf_that_overflows_after_unscaling_is_named():
    # A float16 gradient of a float16 parameter, finite as given, overflows when
    # divided by a scale of 1/4: that leaf is the one named.
    params = {"a": jnp.ones(3, jnp.float16), "b": jnp.ones(3, jnp.float16)}
    grads = {"a": jnp.ones(3, jnp.float16), "b": jnp.full(3, 30000.0, jnp.float16)}
    state = lossscale.DynamicLossScale(scale=0.25, min_scale=2.0**-4)
    _, _, loss_scale = lossscale.apply_gradients(
        optax.sgd(0.1),
        grads=grads,
        params=params,
        opt_state=optax.sgd(0.1).init(params),
        loss_scale=state,
    )
    assert int(loss_scale.overflow_leaf) == 1


def test_apply_gradients_train_state_and_nnx_optimizer_record_it():
    assert apply_gradients_overflow_leaf(5) == 5
    params, grads = params_and_grads(5)

    state = lossscale.flax.TrainState.create(
        apply_fn=None, params=params, tx=optax.sgd(0.1), loss_scale=4.0
    )
    state = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, grads)
    assert int(lossscale.metrics(state)["overflow_leaf"]) == 5

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    optimizer = lossscale.flax.Optimizer(
        model, optax.sgd(0.1), wrt=nnx.Param, loss_scale=4.0
    )
    grads = nnx.state(model, nnx.Param)
    grads = jax.tree.map(lambda g: jnp.full_like(g, jnp.nan), grads)
    optimizer.update(model, grads)
    index = lossscale.metrics(optimizer)["overflow_leaf"]
    # nnx's Param state flattens to bias, kernel: the first of them is named.
    assert lossscale.diagnostics.leaf_path(nnx.state(model, nnx.Param), index) == (
        jax.tree_util.keystr(
            jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))[0][0]
        )
    )
    assert int(index) == 0


def test_under_shard_map_every_device_agrees_on_the_first_leaf(mesh):
    params, _ = params_and_grads()
    tx = lossscale.wrap(optax.sgd(0.1), 4.0, axis_name="data")
    # Device d puts an inf into leaf 6 - d (devices 0..5), or none (6, 7): the
    # first non-finite leaf over all of them is leaf 1, on device 5.
    per_device = []
    for device in range(8):
        bad = 6 - device if device < 6 else None
        per_device.append(params_and_grads(bad)[1])
    grads = jax.tree.map(lambda *xs: jnp.stack(xs), *per_device)

    @jax.jit
    @functools.partial(
        jax.shard_map, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data")
    )
    def step(grads, params):
        grads = jax.tree.map(lambda g: g[0], grads)
        _, opt_state = tx.update(grads, tx.init(params), params)
        return lossscale.metrics(opt_state)["overflow_leaf"][None]

    np.testing.assert_array_equal(step(grads, params), np.full(8, 1))


def test_under_multisteps_the_accumulated_gradients_are_checked():
    params, _ = params_and_grads()
    tx = lossscale.wrap(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2), 4.0)
    step = jax.jit(tx.update)
    opt_state = tx.init(params)
    seen = []
    for bad in [None, None, 3, None]:
        _, grads = params_and_grads(bad)
        _, opt_state = step(grads, opt_state, params)
        seen.append(int(lossscale.metrics(opt_state)["overflow_leaf"]))
    assert seen == [-1, -1, 3, 3]


@pytest.mark.parametrize(
    "index, error",
    [(7, ValueError), (-2, ValueError), (1.5, TypeError), (jnp.arange(2), TypeError)],
)
def test_leaf_path_refuses_what_names_no_leaf(index, error):
    params, _ = params_and_grads()
    with pytest.raises(error, match="`index`"):
        lossscale.diagnostics.leaf_path(params, index)


@pytest.mark.parametrize("index", [True, False, np.bool_(True), jnp.array(True)])
def test_leaf_path_refuses_a_bool(index):
    params, _ = params_and_grads()
    with pytest.raises(TypeError, match="bools are not indices"):
        lossscale.diagnostics.leaf_path(params, index)


def test_leaf_path_under_jit_says_to_call_it_on_the_host():
    params, _ = params_and_grads()
    with pytest.raises(TypeError, match="runs on the host") as info:
        jax.jit(lambda i: lossscale.diagnostics.leaf_path(params, i))(jnp.int32(1))
    assert "overflow_leaf" in str(info.value)


def test_leaf_path_of_an_index_per_device_says_to_take_one():
    params, _ = params_and_grads()
    with pytest.raises(TypeError, match=r"pass `index\[0\]`"):
        lossscale.diagnostics.leaf_path(params, jnp.full(8, 3, jnp.int32))


def test_leaf_path_with_swapped_arguments_says_so():
    params, _ = params_and_grads()
    with pytest.raises(TypeError, match=r"`leaf_path\(params, index\)`"):
        lossscale.diagnostics.leaf_path(2, params)


def reference_gradient_paths(grads):
    """`jax.tree.leaves(grads)`'s paths, as the docs define the index: no None."""
    return [
        jax.tree_util.keystr(path)
        for path, _ in jax.tree_util.tree_leaves_with_path(grads)
    ]


def test_leaf_path_indexes_the_gradient_leaves_none_dropped():
    grads = {"a": jnp.ones(2), "act": None, "b": jnp.ones(2), "c": (None, jnp.ones(1))}
    expected = reference_gradient_paths(grads)
    assert expected == ["['a']", "['b']", "['c'][1]"]
    got = [lossscale.diagnostics.leaf_path(grads, i) for i in range(len(expected))]
    assert got == expected
    assert lossscale.diagnostics.leaf_path(grads, jnp.int32(-1)) is None
    with pytest.raises(ValueError, match="`index` is 3"):
        lossscale.diagnostics.leaf_path(grads, 3)


def test_leaf_path_of_an_equinox_model_matches_its_filtered_gradients():
    import equinox as eqx

    keys = jax.random.split(jax.random.key(0), 2)
    model = eqx.nn.Sequential(
        [
            eqx.nn.Linear(2, 2, key=keys[0]),
            eqx.nn.Lambda(jax.nn.relu),  # a function leaf between the layers
            eqx.nn.Linear(2, 2, key=keys[1]),
        ]
    )
    grads = eqx.filter_grad(lambda m, x: jnp.sum(m(x)))(model, jnp.ones(2))
    expected = reference_gradient_paths(grads)
    assert len(expected) == 4
    for index, path in enumerate(expected):
        assert lossscale.diagnostics.leaf_path(model, index) == path
        assert lossscale.diagnostics.leaf_path(grads, index) == path
