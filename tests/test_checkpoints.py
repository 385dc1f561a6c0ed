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
    lossscale.check_config(saved, state)


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
        lossscale.check_config(saved, second)
    else:
        with pytest.raises(ValueError, match="another loss scale than the code's"):
            lossscale.check_config(saved, second)


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
        lossscale.check_config(saved, lossscale.DynamicLossScale())
    if not (isinstance(saved, dict) and isinstance(saved.get("kind"), str)):
        # The layout reads only the kind: refused alike.
        with pytest.raises(ValueError, match=match):
            lossscale.checkpoint_0_2_layout(saved)


def test_check_config_with_its_arguments_swapped_says_so():
    state = lossscale.DynamicLossScale()
    with pytest.raises(TypeError, match="swap them"):
        lossscale.check_config(state, state.get_config())


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
                loss_scale=lossscale.checkpoint_0_2_layout(configs.dynamic_config)
            ),
            "static": lossscale.checkpoint_0_2_layout(configs.static_config),
        }
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        restored = manager.restore(
            7, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
        ).state
    dynamic = lossscale.from_checkpoint_0_2(
        restored["opt_state"].loss_scale, configs.dynamic_config
    )
    static = lossscale.from_checkpoint_0_2(restored["static"], configs.static_config)
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
    restored = lossscale.from_checkpoint_0_2(
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
        lossscale.from_checkpoint_0_2(arrays, config)


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
    layout = lossscale.checkpoint_0_2_layout(config, batch_shape=(devices,))
    arrays = stacked_0_2_arrays(devices)
    assert {k: v.shape for k, v in layout.items()} == {
        k: v.shape for k, v in arrays.items()
    }
    state = lossscale.from_checkpoint_0_2(arrays, config)
    for name, leaf in zip(type(state)._leaves, jax.tree.leaves(state), strict=True):
        assert leaf.shape == (devices,), (name, leaf.shape)
    np.testing.assert_array_equal(state.overflow_leaf, np.full(devices, -1))
    stepped = jax.pmap(lambda s: lossscale.update(s, jnp.asarray(True)))(state)
    for device in range(devices):
        one = lossscale.from_checkpoint_0_2(
            {k: v[device] for k, v in arrays.items()}, config
        )
        expected = lossscale.update(one, jnp.asarray(True))
        for got, want in zip(
            jax.tree.leaves(stepped), jax.tree.leaves(expected), strict=True
        ):
            assert np.asarray(got)[device] == np.asarray(want), (device, got, want)


def test_stacked_arrays_must_agree_on_their_leading_shape():
    arrays = stacked_0_2_arrays(4)
    arrays["float32_fields"] = arrays["float32_fields"][:2]
    with pytest.raises(ValueError, match="after the leading dimensions"):
        lossscale.from_checkpoint_0_2(arrays, DYNAMIC_CONFIG)


def test_the_layout_given_instead_of_the_restored_arrays_says_what_to_pass():
    # Issue 33: an unclear `int()` TypeError.
    layout = lossscale.checkpoint_0_2_layout(DYNAMIC_CONFIG)
    with pytest.raises(TypeError, match="restore target.*pass the restored arrays"):
        lossscale.from_checkpoint_0_2(layout, DYNAMIC_CONFIG)


def test_other_mix_ups_of_from_checkpoint_0_2_say_what_to_pass():
    arrays = stacked_0_2_arrays(1)
    arrays = {k: v[0] for k, v in arrays.items()}
    with pytest.raises(TypeError, match="swap them"):
        lossscale.from_checkpoint_0_2(DYNAMIC_CONFIG, arrays)
    with pytest.raises(TypeError, match="a 0.3 state already: use it as it is"):
        lossscale.from_checkpoint_0_2(lossscale.DynamicLossScale(), DYNAMIC_CONFIG)
    restored = {"params": {"w": np.zeros(2)}, "opt_state": {"loss_scale": arrays}}
    with pytest.raises(ValueError, match=r"at `arrays\['opt_state'\]\['loss_scale'\]`"):
        lossscale.from_checkpoint_0_2(restored, DYNAMIC_CONFIG)
    with pytest.raises(TypeError, match="`batch_shape` must be a tuple of ints"):
        lossscale.checkpoint_0_2_layout(DYNAMIC_CONFIG, batch_shape=8)
