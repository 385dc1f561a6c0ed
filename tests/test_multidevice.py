"""Multi-device: sharded `jit`, `shard_map` and `pmap` agree on every skip.

Runs on eight simulated CPU devices (see conftest.py), also on a GPU machine.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import DEVICES
from helpers import init_params
from helpers import per_device_grads
from helpers import scaled_loss_step
from helpers import stacked
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lossscale

pytestmark = pytest.mark.skipif(len(DEVICES) < 8, reason="needs 8 CPU devices")

COLLECTIVE = re.compile(
    r"\b(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)"
    r"(?:-start)?\("
)


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["w1"]) @ params["w2"] + params["b"]
    return jnp.mean((h - y) ** 2)


def batch(poison_rows=()):
    x = jax.random.normal(jax.random.key(1), (64, 16))
    y = jax.random.normal(jax.random.key(2), (64, 8))
    for row in poison_rows:
        x = x.at[row].set(jnp.inf)
    return x, y


def shard_values(array):
    return [np.asarray(shard.data) for shard in array.addressable_shards]


def assert_identical_everywhere(tree):
    for leaf in jax.tree.leaves(tree):
        values = shard_values(leaf)
        for value in values[1:]:
            np.testing.assert_array_equal(value, values[0])


# -- jit with sharded arrays: the decision is global as it is ------------------


@pytest.mark.parametrize("params_spec", [P(), P("data")], ids=["dp", "fsdp"])
def test_sharded_jit_skips_globally_when_one_shard_overflows(
    mesh, params_spec, backend_form
):
    tx = lossscale.wrap(optax.adam(1e-2), lossscale.DynamicLossScale(2.0**10))

    def place(tree, spec):
        # Arrays by `spec`, scalars (Adam's count) replicated.
        return jax.tree.map(
            lambda x: jax.device_put(
                x, NamedSharding(mesh, spec if jnp.ndim(x) else P())
            ),
            tree,
        )

    params = place(init_params(), params_spec)
    opt_state = tx.init(params)
    # The loss-scale state is replicated: its leaves are small vectors.
    opt_state = lossscale.WrapState(
        place(opt_state.loss_scale, P()), place(opt_state.inner_state, params_spec)
    )
    batch_sharding = NamedSharding(mesh, P("data"))

    step = scaled_loss_step(tx, loss_fn)
    x, y = jax.device_put(batch(), batch_sharding)
    params, opt_state = step(params, opt_state, x, y)  # applied
    assert int(opt_state.loss_scale.counter) == 1

    # Rows 24..31 live on device 3 only.
    x, y = jax.device_put(batch(poison_rows=[27]), batch_sharding)
    new_params, new_opt_state = step(params, opt_state, x, y)
    assert int(new_opt_state.loss_scale.skipped_steps) == 1
    assert float(new_opt_state.loss_scale.scale) == 2.0**9
    for new, old in zip(
        jax.tree.leaves((new_params, new_opt_state.inner_state)),
        jax.tree.leaves((params, opt_state.inner_state)),
        strict=True,
    ):
        np.testing.assert_array_equal(new, old)
    # The loss-scale state is one replicated value: the same on every device.
    for leaf in jax.tree.leaves(new_opt_state.loss_scale):
        assert leaf.sharding.is_fully_replicated
    assert_identical_everywhere(new_opt_state.loss_scale)


def count_collectives(fn, *args):
    text = jax.jit(fn).lower(*args).compile().as_text()
    lines = [line for line in text.splitlines() if COLLECTIVE.search(line)]
    return lines


def test_sharded_wrap_adds_one_small_collective(mesh):
    sharded = NamedSharding(mesh, P("data"))
    params = jax.device_put({f"p{i}": jnp.ones((64, 8)) for i in range(12)}, sharded)
    grads = jax.tree.map(lambda p: p * 0.5, params)
    plain, wrapped = optax.adam(1e-3), lossscale.wrap(optax.adam(1e-3))
    plain_lines = count_collectives(plain.update, grads, plain.init(params), params)
    wrapped_lines = count_collectives(
        wrapped.update, grads, wrapped.init(params), params
    )
    extra = len(wrapped_lines) - len(plain_lines)
    assert extra <= 1, wrapped_lines
    for line in wrapped_lines:
        # XLA combines the partial sums into one all-reduce: one float per small
        # leaf (the check keeps a flag per leaf, for `overflow_leaf`), or scalars.
        result_type = line.split("=", 1)[1].split(COLLECTIVE.search(line).group(1))[0]
        shapes = re.findall(r"[a-z0-9]+\[([^\]]*)\]", result_type)
        sizes = [int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes]
        assert sizes and sum(sizes) <= len(params), line


# -- shard_map and pmap: agree over the named axis ------------------------------


@pytest.mark.parametrize("path", ["wrap", "apply_gradients"])
@pytest.mark.parametrize("axis_name", ["data", None])
def test_shard_map_with_axis_name_makes_every_device_skip(
    mesh, axis_name, path, backend_form
):
    tx = lossscale.wrap(optax.sgd(0.1), 64.0, axis_name=axis_name)
    params = stacked(init_params())
    opt_state = stacked(tx.init(init_params()))

    def local_step(grads, opt_state, params):
        squeeze = lambda t: jax.tree.map(lambda x: x[0], t)  # noqa: E731
        grads, opt_state, params = squeeze(grads), squeeze(opt_state), squeeze(params)
        if path == "wrap":
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        else:
            params, inner_state, loss_scale = lossscale.apply_gradients(
                optax.sgd(0.1),
                grads=grads,
                params=params,
                opt_state=opt_state.inner_state,
                loss_scale=opt_state.loss_scale,
                axis_name=axis_name,
            )
            opt_state = lossscale.WrapState(loss_scale, inner_state)
        return jax.tree.map(lambda x: x[None], (params, opt_state))

    step = jax.jit(
        jax.shard_map(
            local_step,
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P("data"),
        )
    )
    new_params, new_opt_state = step(per_device_grads(5), opt_state, params)
    skipped = np.asarray(new_opt_state.loss_scale.skipped_steps)
    if axis_name is None:
        # Without the axis, only device 5 skips: the replicas drift apart.
        np.testing.assert_array_equal(skipped, [0, 0, 0, 0, 0, 1, 0, 0])
        assert not np.array_equal(new_params["w2"][5], new_params["w2"][4])
    else:
        np.testing.assert_array_equal(skipped, np.ones(8))
        for new, old in zip(
            jax.tree.leaves(new_params), jax.tree.leaves(params), strict=True
        ):
            np.testing.assert_array_equal(new, old)


def test_pmap_with_axis_name_keeps_identical_dynamic_states(backend_form):
    tx = lossscale.wrap(
        optax.adam(1e-2), lossscale.DynamicLossScale(8.0), axis_name="i"
    )
    params = stacked(init_params())
    opt_state = stacked(tx.init(init_params()))

    def step(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    pstep = jax.pmap(step, axis_name="i", devices=DEVICES[:8])
    finite = jax.tree.map(lambda g: g / 8.0, per_device_grads(0))
    finite["w1"] = finite["w1"].at[0, 0, 0].set(1.0)
    params, opt_state = pstep(finite, opt_state, params)
    params, opt_state = pstep(per_device_grads(6), opt_state, params)
    scales = np.asarray(opt_state.loss_scale.scale)
    np.testing.assert_array_equal(scales, np.full(8, 4.0, np.float32))
    np.testing.assert_array_equal(
        np.asarray(opt_state.loss_scale.skipped_steps), np.ones(8)
    )
    np.testing.assert_array_equal(
        np.asarray(opt_state.inner_state[0].count), np.ones(8)
    )


def test_all_finite_over_a_named_axis(mesh):
    def check(x):
        return lossscale.all_finite({"x": x}, axis_name="data")[None]

    fn = jax.jit(
        jax.shard_map(check, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    )
    x = jnp.ones((8, 4))
    np.testing.assert_array_equal(fn(x), np.ones(8, bool))
    np.testing.assert_array_equal(fn(x.at[2, 1].set(jnp.nan)), np.zeros(8, bool))


@pytest.mark.parametrize("axis_name", [3, ("a", 1), (), ["data"]])
def test_bad_axis_names_are_refused(axis_name):
    with pytest.raises(TypeError, match="axis_name"):
        lossscale.wrap(optax.sgd(0.1), axis_name=axis_name)
    with pytest.raises(TypeError, match="axis_name"):
        lossscale.all_finite(jnp.ones(2), axis_name=axis_name)


def test_all_finite_outside_the_mapped_function_says_what_to_do():
    with pytest.raises(ValueError, match="binds the axis 'data'") as info:
        jax.jit(lambda x: lossscale.all_finite(x, axis_name="data"))(jnp.ones(2))
    assert "all_finite" in str(info.value) and "drop `axis_name`" in str(info.value)


@pytest.mark.parametrize("path", ["wrap", "apply_gradients"])
def test_the_step_outside_the_mapped_function_says_what_to_do(path):
    params = {"w": jnp.ones(3)}
    grads = {"w": jnp.full(3, 2.0)}
    tx = optax.sgd(0.1)
    if path == "wrap":
        wrapped = lossscale.wrap(tx, 2.0, axis_name="data")
        call = lambda: wrapped.update(grads, wrapped.init(params), params)  # noqa: E731
    else:
        call = lambda: lossscale.apply_gradients(  # noqa: E731
            tx, grads=grads, params=params, opt_state=tx.init(params),
            loss_scale=lossscale.StaticLossScale(2.0), axis_name="data",
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"binds the axis 'data'.*jax.pmap"):
        jax.jit(call)()
