"""Finding the loss-scale state (`_src/api/lookup.py`): every function that takes
"a state or a tree holding one" finds it the same way and fails the same way."""

import jax.numpy as jnp
import optax
import pytest

import lossscale

GRADS = {"w": jnp.ones(2)}
FINDERS = {
    "get_loss_scale": lossscale.get_loss_scale,
    "metrics": lossscale.metrics,
    "scale_loss": lambda s: lossscale.scale_loss(jnp.float32(1.0), s),
    "unscale_grads": lambda s: lossscale.unscale_grads(GRADS, s),
    "check_config": lambda s: lossscale.checkpoints.check_config(
        {"kind": "static", "value": 4.0}, s
    ),
    "value_and_grad": lambda s: lossscale.value_and_grad(jnp.sum)(s, GRADS["w"]),
}


@pytest.mark.parametrize("finder", FINDERS.values(), ids=FINDERS)
@pytest.mark.parametrize("spec", ["dynamic", 1024.0, None, jnp.float32(8.0)])
def test_a_spec_is_refused_with_what_to_pass(finder, spec):
    with pytest.raises(TypeError, match="describes a\\s+loss scale to create"):
        finder(spec)


@pytest.mark.parametrize("finder", FINDERS.values(), ids=FINDERS)
def test_a_tree_without_a_state_or_with_two_is_a_value_error(finder):
    with pytest.raises(ValueError, match="No loss-scale state found"):
        finder(optax.sgd(0.1).init(GRADS))
    twice = (
        lossscale.wrap(optax.sgd(0.1)).init(GRADS),
        lossscale.wrap(optax.sgd(0.1)).init(GRADS),
    )
    with pytest.raises(ValueError, match="holds 2 loss-scale states, at \\[0\\]"):
        finder(twice)


@pytest.mark.parametrize("finder", FINDERS.values(), ids=FINDERS)
def test_the_state_is_found_inside_chains_and_multisteps(finder):
    tx = optax.chain(
        optax.clip(1.0), lossscale.wrap(optax.MultiSteps(optax.sgd(0.1), 2), 4.0)
    )
    opt_state = tx.init(GRADS)
    assert lossscale.get_loss_scale(opt_state).value == 4.0
    finder(opt_state)  # no error


@pytest.mark.parametrize("finder", FINDERS.values(), ids=FINDERS)
def test_the_optimizer_itself_is_refused_with_what_to_pass(finder):
    tx = lossscale.wrap(optax.sgd(0.1))
    with pytest.raises(TypeError, match="optax transformation") as info:
        finder(tx)
    assert "tx.init(params)" in str(info.value)
