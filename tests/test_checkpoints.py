"""Checkpoints (`_src/compat/checkpoints.py`): `get_config`, `from_config` and
`check_config`, and a lossscale 0.2 checkpoint (`data/checkpoint_0_2`, written by
0.2 with `data/make_checkpoint_0_2.py`) restored into 0.3 states, field by field.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import lossscale
import lossscale.flax

# 0.3's functions behind the deprecated `lossscale.<name>` aliases, which
# `lossscale.checkpoints.layout` and `upgrade` call: their own edge cases.
from lossscale._src.compat.checkpoint_0_3_0 import checkpoint_0_3_0_layout
from lossscale._src.compat.checkpoint_0_3_0 import from_checkpoint_0_3_0
from lossscale._src.compat.checkpoints import checkpoint_0_2_layout
from lossscale._src.compat.checkpoints import from_checkpoint_0_2

STATES = [
    lossscale.NoOpLossScale(),
    lossscale.StaticLossScale(0.7),
    lossscale.DynamicLossScale(),
    lossscale.DynamicLossScale(
        scale=4.0,
        growth_interval=3,
        growth_factor=3.0,
        backoff_factor=0.25,
        min_scale=2.0,
        max_scale=8.0,
        hysteresis=2,
    ),
]


@pytest.mark.parametrize("state", STATES, ids=repr)
def test_config_survives_json_and_rebuilds_the_same_settings(state):
    saved = json.loads(json.dumps(state.get_config()))
    rebuilt = lossscale.LossScale.from_config(saved)
    assert type(rebuilt) is type(state)
    assert jax.tree.structure(rebuilt) == jax.tree.structure(state)  # settings
    assert rebuilt.get_config() == saved
    lossscale.checkpoints.check_config(saved, state)


def test_config_reads_through_optimizer_states():
    opt_state = lossscale.wrap(optax.sgd(0.1), 64.0).init(jnp.zeros(2))
    assert lossscale.get_loss_scale(opt_state).get_config() == {
        "kind": "static",
        "value": 64.0,
    }


def test_from_config_starts_a_dynamic_scale_within_its_bounds():
    saved = STATES[3].get_config()
    assert float(lossscale.LossScale.from_config(saved).scale) == 8.0


@pytest.mark.parametrize("first", STATES, ids=repr)
@pytest.mark.parametrize("second", STATES, ids=repr)
def test_check_config_refuses_every_other_kind_or_setting(first, second):
    saved = first.get_config()
    if first is second:
        lossscale.checkpoints.check_config(saved, second)
    else:
        with pytest.raises(ValueError, match="another loss scale than the code's"):
            lossscale.checkpoints.check_config(saved, second)


@pytest.mark.parametrize(
    "saved, match",
    [
        ("dynamic", "must be a dict"),
        ({"kind": "fixed"}, r"`config\['kind'\]` must be one of \['dynamic'"),
        ({"kind": "static"}, r"\['value'\]"),
        ({"kind": "static", "value": 2.0, "extra": 1}, "extra"),
        ({"kind": "static", "value": -2.0}, "positive"),
    ],
)
def test_from_config_refuses_what_config_cannot_have_written(saved, match):
    with pytest.raises(ValueError, match=match):
        lossscale.LossScale.from_config(saved)


DYNAMIC_CONFIG = lossscale.DynamicLossScale().get_config()


@pytest.mark.parametrize(
    "saved, match",
    [
        # Issue 33: a bare `unhashable type: 'list'`.
        ({"kind": ["dynamic"]}, r"`config\['kind'\]` must be a kind's name, a string"),
        ({"kind": None}, r"`config\['kind'\]` must be a kind's name.*NoneType"),
        ({"growth_interval": 3}, "must have the key 'kind'"),
        ('{"kind": "dynamic"}', r"json.loads\(text\)"),
        (lossscale.DynamicLossScale(), r"Pass `state.get_config\(\)`, not the state"),
        (lossscale.DynamicLossScale().get_config, r"Call it: `state.get_config\(\)`"),
        (
            {**DYNAMIC_CONFIG, "growth_intervall": 3},
            r"unknown \['growth_intervall' \(did you mean 'growth_interval'\?\)\]",
        ),
        (
            {k: v for k, v in DYNAMIC_CONFIG.items() if k != "hysteresis"},
            r"missing \['hysteresis'\]",
        ),
    ],
    ids=lambda x: repr(x)[:30],
)
def test_a_malformed_config_is_refused_naming_the_key_and_what_is_allowed(saved, match):
    with pytest.raises(ValueError, match=match):
        lossscale.LossScale.from_config(saved)
    with pytest.raises(ValueError, match=match):
        lossscale.checkpoints.check_config(saved, lossscale.DynamicLossScale())
    if not (isinstance(saved, dict) and isinstance(saved.get("kind"), str)):
        # The layout reads only the kind: refused alike.
        with pytest.raises(ValueError, match=match):
            checkpoint_0_2_layout(saved)


def test_check_config_with_its_arguments_swapped_says_so():
    state = lossscale.DynamicLossScale()
    with pytest.raises(TypeError, match="swap them"):
        lossscale.checkpoints.check_config(state, state.get_config())


DATA = os.path.join(os.path.dirname(__file__), "data")
with open(os.path.join(DATA, "checkpoint_0_2_expected.json")) as f:
    EXPECTED = json.load(f)


def restore_0_2(directory):
    """The checkpoint guide's recipe for a 0.2 checkpoint."""
    with ocp.CheckpointManager(directory) as manager:
        configs = manager.restore(
            7,
            args=ocp.args.Composite(
                dynamic_config=ocp.args.JsonRestore(),
                static_config=ocp.args.JsonRestore(),
            ),
        )
        tx = lossscale.wrap(optax.adam(1e-2), lossscale.DynamicLossScale())
        params = {"w": jnp.zeros((2, 3))}
        opt_state = tx.init(params)
        # The 0.2 arrays stand where each loss-scale state goes in the target.
        target = {
            "params": params,
            "opt_state": opt_state._replace(
                loss_scale=checkpoint_0_2_layout(configs.dynamic_config)
            ),
            "static": checkpoint_0_2_layout(configs.static_config),
        }
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        restored = manager.restore(
            7, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
        ).state
    dynamic = from_checkpoint_0_2(
        restored["opt_state"].loss_scale, configs.dynamic_config
    )
    static = from_checkpoint_0_2(restored["static"], configs.static_config)
    return restored, dynamic, static, configs


def test_a_0_2_checkpoint_restores_every_field(tmp_path):
    directory = tmp_path / "checkpoint"
    shutil.copytree(os.path.join(DATA, "checkpoint_0_2"), directory)
    restored, dynamic, static, configs = restore_0_2(directory)
    assert isinstance(dynamic, lossscale.DynamicLossScale)
    assert isinstance(static, lossscale.StaticLossScale)
    for state, expected in [
        (dynamic, EXPECTED["dynamic"]),
        (static, EXPECTED["static"]),
    ]:
        for name, value in expected.items():
            assert np.asarray(getattr(state, name)).tolist() == value, name
            assert getattr(state, name).dtype == type(state)._specs[name].dtype
    assert dynamic.get_config() == configs.dynamic_config
    assert (dynamic.growth_interval, dynamic.hysteresis) == (3, 2)
    assert static.value == configs.static_config["scale"] == 256.0
    np.testing.assert_array_equal(restored["params"]["w"], EXPECTED["params"])


def test_a_restored_0_2_state_trains_on():
    tx = lossscale.wrap(optax.adam(1e-2), lossscale.DynamicLossScale())
    # As restored, the state goes back into the optimizer state and steps on:
    # one more finite step makes 2 in a row, the next the 3rd: the scale grows.
    restored = from_checkpoint_0_2(
        {
            "int32_fields": np.array([2, 0, 0, 0, 1, 2], np.int32),
            "float32_fields": np.array([512.0], np.float32),
        },
        {**lossscale.DynamicLossScale(growth_interval=3, hysteresis=2).get_config()},
    )
    params = {"w": jnp.ones(3)}
    opt_state = tx.init(params)._replace(loss_scale=restored)
    step = jax.jit(tx.update)
    for _ in range(2):
        _, opt_state = step({"w": jnp.ones(3)}, opt_state, params)
    assert float(opt_state.loss_scale.scale) == 1024.0


@pytest.mark.parametrize(
    "arrays, config, match",
    [
        ({}, {"kind": "nope"}, "'kind' is one of"),
        ({"int32_fields": np.zeros(6)}, {"kind": "dynamic"}, "float32_fields"),
        (
            {"int32_fields": np.zeros(5), "float32_fields": np.zeros(1)},
            lossscale.DynamicLossScale().get_config(),
            "must have 6 elements",
        ),
    ],
)
def test_arrays_of_another_layout_are_refused(arrays, config, match):
    with pytest.raises(ValueError, match=match):
        from_checkpoint_0_2(arrays, config)


def stacked_0_2_arrays(devices):
    """Per-device 0.2 arrays of a dynamic state, and the fields each holds."""
    # 0.2's int32 order: skipped_steps, consecutive_skips, forward_overflows,
    # stuck, counter, overflows_since_growth; float32: scale.
    ints = np.array([[d, d % 2, 0, 0, d + 1, d % 3] for d in range(devices)], np.int32)
    floats = np.array([[2.0 ** (d + 4)] for d in range(devices)], np.float32)
    return {"int32_fields": ints, "float32_fields": floats}


def test_a_pmap_stacked_0_2_state_restores_stacked_and_steps_under_pmap():
    # Issue 33: `overflow_leaf` (new in 0.3) stayed a scalar, so pmap refused it.
    devices = jax.local_device_count()
    config = lossscale.DynamicLossScale(growth_interval=3, hysteresis=2).get_config()
    layout = checkpoint_0_2_layout(config, batch_shape=(devices,))
    arrays = stacked_0_2_arrays(devices)
    assert {k: v.shape for k, v in layout.items()} == {
        k: v.shape for k, v in arrays.items()
    }
    state = from_checkpoint_0_2(arrays, config)
    for name, leaf in zip(type(state)._leaves, jax.tree.leaves(state), strict=True):
        assert leaf.shape == (devices,), (name, leaf.shape)
    np.testing.assert_array_equal(state.overflow_leaf, np.full(devices, -1))
    stepped = jax.pmap(lambda s: lossscale.update(s, jnp.asarray(True)))(state)
    for device in range(devices):
        one = from_checkpoint_0_2({k: v[device] for k, v in arrays.items()}, config)
        expected = lossscale.update(one, jnp.asarray(True))
        for got, want in zip(
            jax.tree.leaves(stepped), jax.tree.leaves(expected), strict=True
        ):
            assert np.asarray(got)[device] == np.asarray(want), (device, got, want)


def test_stacked_arrays_must_agree_on_their_leading_shape():
    arrays = stacked_0_2_arrays(4)
    arrays["float32_fields"] = arrays["float32_fields"][:2]
    with pytest.raises(ValueError, match="after the leading dimensions"):
        from_checkpoint_0_2(arrays, DYNAMIC_CONFIG)


def test_the_layout_given_instead_of_the_restored_arrays_says_what_to_pass():
    # Issue 33: an unclear `int()` TypeError.
    layout = checkpoint_0_2_layout(DYNAMIC_CONFIG)
    with pytest.raises(TypeError, match="restore target.*pass the restored arrays"):
        from_checkpoint_0_2(layout, DYNAMIC_CONFIG)


def test_other_mix_ups_of_from_checkpoint_0_2_say_what_to_pass():
    arrays = stacked_0_2_arrays(1)
    arrays = {k: v[0] for k, v in arrays.items()}
    with pytest.raises(TypeError, match="swap them"):
        from_checkpoint_0_2(DYNAMIC_CONFIG, arrays)
    with pytest.raises(TypeError, match="a 0.3 state already: use it as it is"):
        from_checkpoint_0_2(lossscale.DynamicLossScale(), DYNAMIC_CONFIG)
    restored = {"params": {"w": np.zeros(2)}, "opt_state": {"loss_scale": arrays}}
    with pytest.raises(ValueError, match=r"at `arrays\['opt_state'\]\['loss_scale'\]`"):
        from_checkpoint_0_2(restored, DYNAMIC_CONFIG)
    with pytest.raises(TypeError, match="`batch_shape` must be a tuple of ints"):
        checkpoint_0_2_layout(DYNAMIC_CONFIG, batch_shape=8)


# -- a lossscale 0.3.0 checkpoint (`data/checkpoint_0_3_0`, written by 0.3.0 with
# `data/make_checkpoint_0_3_0.py`): the states had no `overflow_scale` then.

with open(os.path.join(DATA, "checkpoint_0_3_0_expected.json")) as f:
    EXPECTED_0_3_0 = json.load(f)


def targets_0_3_0():
    """Fresh trees of the structures the 0.3.0 checkpoint holds, as built today."""
    from flax import nnx

    dynamic = lossscale.DynamicLossScale(scale=2.0**10, growth_interval=3, hysteresis=2)
    params = {"w": jnp.zeros((2, 3))}
    state = {
        "params": params,
        "opt_state": lossscale.wrap(optax.adam(1e-2), dynamic).init(params),
        "static": lossscale.StaticLossScale(256),
        "train_state": lossscale.flax.TrainState.create(
            apply_fn=None,
            params={"w": jnp.zeros(3)},
            tx=optax.sgd(0.1),
            loss_scale=dynamic,
        ),
    }
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(1))
    optimizer = lossscale.flax.Optimizer(
        model, optax.adam(1e-2), wrt=nnx.Param, loss_scale=dynamic
    )
    return state, optimizer


def assert_as_0_3_0_saved(states):
    for name, state in states.items():
        for field, value in EXPECTED_0_3_0[name].items():
            got = getattr(state, field)
            assert np.asarray(got).tolist() == value, (name, field, got, value)
            assert got.dtype == type(state)._specs[field].dtype, (name, field)
        # Not in the checkpoint: the default, "no skip recorded".
        assert float(state.overflow_scale) == 0.0, name


def test_a_0_3_0_checkpoint_restores_every_field_through_its_layout(tmp_path):
    directory = tmp_path / "checkpoint"
    shutil.copytree(os.path.join(DATA, "checkpoint_0_3_0"), directory)
    target, _ = targets_0_3_0()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    with ocp.CheckpointManager(directory) as manager:
        # Today's target alone is refused: the checkpoint lacks `overflow_scale`.
        with pytest.raises(ValueError, match="overflow_scale"):
            manager.restore(
                7, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
            )
        layout = checkpoint_0_3_0_layout(abstract)
        restored = manager.restore(
            7, args=ocp.args.Composite(state=ocp.args.StandardRestore(layout))
        ).state
        config = manager.restore(
            7, args=ocp.args.Composite(dynamic_config=ocp.args.JsonRestore())
        ).dynamic_config
    restored = from_checkpoint_0_3_0(restored, abstract)
    assert jax.tree.structure(restored) == jax.tree.structure(target)
    lossscale.checkpoints.check_config(config, restored["opt_state"])
    assert_as_0_3_0_saved(
        {
            "dynamic": restored["opt_state"].loss_scale,
            "static": restored["static"],
            "train_state": restored["train_state"].loss_scale,
        }
    )
    np.testing.assert_array_equal(restored["params"]["w"], EXPECTED_0_3_0["params"])
    assert int(restored["train_state"].step) == 2  # 3 steps, 1 skipped
    # And it trains on: a skip now records its scale.
    tx = lossscale.wrap(optax.adam(1e-2), lossscale.DynamicLossScale())
    params = restored["params"]
    _, opt_state = jax.jit(tx.update)(
        {"w": jnp.full((2, 3), jnp.inf)}, restored["opt_state"], params
    )
    assert float(opt_state.loss_scale.overflow_scale) == 512.0
    assert int(opt_state.loss_scale.skipped_steps) == 3


def test_a_0_3_0_nnx_optimizer_checkpoint_restores_through_its_layout(tmp_path):
    from flax import nnx

    directory = tmp_path / "checkpoint"
    shutil.copytree(os.path.join(DATA, "checkpoint_0_3_0"), directory)
    _, optimizer = targets_0_3_0()
    layout = checkpoint_0_3_0_layout(nnx.state(optimizer))
    assert "overflow_scale" not in layout["opt_state"]["loss_scale"]
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, layout)
    with ocp.CheckpointManager(directory) as manager:
        restored = manager.restore(
            7, args=ocp.args.Composite(nnx=ocp.args.StandardRestore(abstract))
        ).nnx
    nnx.update(optimizer, restored)
    assert_as_0_3_0_saved({"nnx": optimizer.loss_scale})
    assert int(optimizer.step[...]) == 2


def test_a_0_3_0_flax_serialization_state_dict_restores_as_it_is():
    from flax import serialization

    target, _ = targets_0_3_0()
    with open(os.path.join(DATA, "checkpoint_0_3_0.msgpack"), "rb") as f:
        restored = serialization.from_bytes(target, f.read())
    assert_as_0_3_0_saved(
        {
            "dynamic": restored["opt_state"].loss_scale,
            "static": restored["static"],
            "train_state": restored["train_state"].loss_scale,
        }
    )
    np.testing.assert_array_equal(restored["params"]["w"], EXPECTED_0_3_0["params"])


def test_a_stacked_0_3_0_state_restores_stacked():
    target = lossscale.DynamicLossScale()
    saved = {
        n: jnp.stack([getattr(target, n)] * 3)
        for n in checkpoint_0_3_0_layout({"s": target})["s"]
    }
    state = from_checkpoint_0_3_0({"s": saved}, {"s": target})["s"]
    for name, leaf in zip(type(state)._leaves, jax.tree.leaves(state), strict=True):
        assert leaf.shape == (3,), (name, leaf.shape)


def test_mix_ups_of_the_0_3_0_restore_say_what_to_pass():
    target = {"w": jnp.zeros(2), "s": lossscale.DynamicLossScale()}
    with pytest.raises(ValueError, match="holds no loss-scale state"):
        checkpoint_0_3_0_layout({"w": jnp.zeros(2)})
    with pytest.raises(TypeError, match=r"`restored\['s'\]` is a `DynamicLossScale`"):
        from_checkpoint_0_3_0(target, target)
    layout = checkpoint_0_3_0_layout(target)
    del layout["s"]["counter"]
    with pytest.raises(ValueError, match=r"`restored\['s'\]` must hold the fields"):
        from_checkpoint_0_3_0(layout, target)


# -- `lossscale.checkpoints.layout` and `upgrade`: any known version, one recipe ------


def _assert_same_states(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b), (a, b)


def test_a_0_2_checkpoint_restores_through_layout_and_upgrade(tmp_path):
    directory = tmp_path / "checkpoint"
    shutil.copytree(os.path.join(DATA, "checkpoint_0_2"), directory)
    with ocp.CheckpointManager(directory) as manager:
        configs = manager.restore(
            7,
            args=ocp.args.Composite(
                dynamic_config=ocp.args.JsonRestore(),
                static_config=ocp.args.JsonRestore(),
            ),
        )
        dynamic = lossscale.LossScale.from_config(configs.dynamic_config)
        # 0.2 saved a static scale's setting as "scale": read, with a warning.
        with pytest.warns(DeprecationWarning, match="'scale' is 'value'"):
            static = lossscale.LossScale.from_config(configs.static_config)
        tx = lossscale.wrap(optax.adam(1e-2), dynamic)
        params = {"w": jnp.zeros((2, 3))}
        target = {"params": params, "opt_state": tx.init(params), "static": static}
        layout = lossscale.checkpoints.layout(target, "0.2")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, layout)
        restored = manager.restore(
            7, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
        ).state
    states = lossscale.checkpoints.upgrade(restored, target)
    shutil.copytree(os.path.join(DATA, "checkpoint_0_2"), tmp_path / "again")
    _, want_dynamic, want_static, _ = restore_0_2(tmp_path / "again")
    _assert_same_states(states["opt_state"].loss_scale, want_dynamic)
    _assert_same_states(states["static"], want_static)
    for name, value in EXPECTED["dynamic"].items():
        assert (
            np.asarray(getattr(states["opt_state"].loss_scale, name)).tolist() == value
        )
    np.testing.assert_array_equal(states["params"]["w"], EXPECTED["params"])


def test_a_0_3_0_checkpoint_restores_through_layout_and_upgrade(tmp_path):
    directory = tmp_path / "checkpoint"
    shutil.copytree(os.path.join(DATA, "checkpoint_0_3_0"), directory)
    target, _ = targets_0_3_0()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    layout = lossscale.checkpoints.layout(abstract, "0.3.0")
    assert layout == checkpoint_0_3_0_layout(abstract)
    with ocp.CheckpointManager(directory) as manager:
        restored = manager.restore(
            7, args=ocp.args.Composite(state=ocp.args.StandardRestore(layout))
        ).state
    states = lossscale.checkpoints.upgrade(restored, abstract)
    _assert_same_states(states, from_checkpoint_0_3_0(restored, abstract))
    assert_as_0_3_0_saved(
        {
            "dynamic": states["opt_state"].loss_scale,
            "static": states["static"],
            "train_state": states["train_state"].loss_scale,
        }
    )


def test_upgrade_keeps_todays_states_and_rebuilds_each_old_one_by_its_layout():
    # One tree, three versions' leaves: each state read by what holds its place.
    dynamic = lossscale.DynamicLossScale(growth_interval=3, hysteresis=2)
    today = lossscale.DynamicLossScale(scale=8.0)
    target = {"a": dynamic, "b": dynamic, "c": today, "w": jnp.ones(2)}
    old = checkpoint_0_3_0_layout({"s": dynamic})["s"]
    restored = {
        "a": {k: v[0] for k, v in stacked_0_2_arrays(1).items()},
        "b": {**old, "skipped_steps": jnp.int32(4)},
        "c": today,
        "w": jnp.full(2, 3.0),
    }
    states = lossscale.checkpoints.upgrade(restored, target)
    _assert_same_states(
        states["a"], from_checkpoint_0_2(restored["a"], dynamic.get_config())
    )
    assert (
        int(states["b"].skipped_steps) == 4 and float(states["b"].overflow_scale) == 0
    )
    assert states["c"] is today
    np.testing.assert_array_equal(states["w"], restored["w"])


def test_layout_0_2_keeps_a_pmap_stacked_states_leading_shape():
    devices = jax.local_device_count()
    state = jax.tree.map(
        lambda x: jnp.broadcast_to(x, (devices, *jnp.shape(x))),
        lossscale.DynamicLossScale(growth_interval=3, hysteresis=2),
    )
    layout = lossscale.checkpoints.layout({"s": state}, "0.2")["s"]
    assert {k: v.shape for k, v in layout.items()} == {
        k: v.shape for k, v in stacked_0_2_arrays(devices).items()
    }
    states = lossscale.checkpoints.upgrade(
        {"s": stacked_0_2_arrays(devices)}, {"s": state}
    )
    for leaf in jax.tree.leaves(states["s"]):
        assert leaf.shape == (devices,)


@pytest.mark.parametrize("version", ["0.3.1", "0.4", 0.2, None])
def test_layout_refuses_a_version_that_needs_none_naming_the_known_ones(version):
    with pytest.raises(
        ValueError, match=r"`version` must be one of \('0.2', '0.3.0'\)"
    ):
        lossscale.checkpoints.layout({"s": lossscale.DynamicLossScale()}, version)


@pytest.mark.parametrize("version", ["0.2", "0.3.0"])
def test_layout_refuses_a_target_without_a_state(version):
    with pytest.raises(ValueError, match="holds no loss-scale state"):
        lossscale.checkpoints.layout({"w": jnp.ones(2)}, version)


@pytest.mark.parametrize("version", ["0.2", "0.3.0"])
def test_upgrade_refuses_the_layout_in_place_of_what_was_restored(version):
    target = jax.eval_shape(lambda: {"s": lossscale.DynamicLossScale()})
    layout = lossscale.checkpoints.layout(target, version)
    with pytest.raises(TypeError, match=r"`restored\['s'\]` holds `ShapeDtypeStruct`s"):
        lossscale.checkpoints.upgrade(layout, target)


def test_upgrade_refuses_leaves_of_no_known_layout_naming_the_layout_to_use():
    target = {"s": lossscale.DynamicLossScale()}
    with pytest.raises(ValueError, match=r"lossscale.checkpoints.layout\(target"):
        lossscale.checkpoints.upgrade({"s": {"scale": jnp.float32(2.0)}}, target)


@pytest.mark.parametrize("same", [("0.2", "0.2.0"), ("0.3.0", "0.3")])
def test_layout_takes_a_release_by_either_spelling(same):
    target = jax.eval_shape(lambda: {"s": lossscale.DynamicLossScale()})
    first, second = (lossscale.checkpoints.layout(target, v) for v in same)
    assert jax.tree.structure(first) == jax.tree.structure(second)
    assert jax.tree.leaves(first) == jax.tree.leaves(second)


def test_upgrade_refuses_a_target_without_a_state_and_says_when_they_are_swapped():
    target = {"s": lossscale.DynamicLossScale()}
    layout = lossscale.checkpoints.layout(target, "0.2")
    with pytest.raises(ValueError, match="holds no loss-scale state: pass the tree"):
        lossscale.checkpoints.upgrade(layout, layout)  # the layout as `target`
    with pytest.raises(ValueError, match=r"and `restored` does: swap them"):
        lossscale.checkpoints.upgrade(target, {"s": layout["s"]})


def test_upgrade_names_the_place_of_a_bad_0_2_array():
    target = {"s": lossscale.DynamicLossScale()}
    arrays = {k: v[0] for k, v in stacked_0_2_arrays(1).items()}
    arrays["int32_fields"] = arrays["int32_fields"][:5]
    with pytest.raises(ValueError, match=r"`restored\['s'\]\['int32_fields'\]` must"):
        lossscale.checkpoints.upgrade({"s": arrays}, target)


def test_an_nnx_optimizers_state_comes_back_for_nnx_update(tmp_path):
    from flax import nnx

    directory = tmp_path / "checkpoint"
    shutil.copytree(os.path.join(DATA, "checkpoint_0_3_0"), directory)
    _, optimizer = targets_0_3_0()
    target = nnx.state(optimizer)
    layout = lossscale.checkpoints.layout(target, "0.3.0")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, layout)
    with ocp.CheckpointManager(directory) as manager:
        restored = manager.restore(
            7, args=ocp.args.Composite(nnx=ocp.args.StandardRestore(abstract))
        ).nnx
    upgraded = lossscale.checkpoints.upgrade(restored, target)
    assert jax.tree.structure(upgraded) == jax.tree.structure(restored)
    nnx.update(optimizer, upgraded)
    assert_as_0_3_0_saved({"nnx": optimizer.loss_scale})
    # 0.2 had no NNX optimizer: its layout says so.
    with pytest.raises(ValueError, match="0.2 had no `lossscale.flax.Optimizer`"):
        lossscale.checkpoints.layout(target, "0.2")
