"""`get_config`, `from_config`, `check_config`: loss-scale settings for checkpoints."""

import json

import jax
import jax.numpy as jnp
import optax
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
        ({"kind": "fixed"}, "must be a dict"),
        ({"kind": "static"}, r"\['value'\]"),
        ({"kind": "static", "value": 2.0, "extra": 1}, "extra"),
        ({"kind": "static", "value": -2.0}, "positive"),
    ],
)
def test_from_config_refuses_what_config_cannot_have_written(saved, match):
    with pytest.raises(ValueError, match=match):
        lossscale.LossScale.from_config(saved)
