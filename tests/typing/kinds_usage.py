"""Loss-scale states as a user's code reads them: every line must type-check."""

from typing import Any
from typing import assert_type

import jax
import jax.numpy as jnp

import lossscale


def built_in_kinds() -> None:
    # The constructors take Python numbers where the docs pass them; the array
    # fields read as arrays.
    dynamic = lossscale.DynamicLossScale(2.0**15)
    assert_type(dynamic, lossscale.DynamicLossScale)
    assert_type(dynamic.scale, jax.Array)
    assert_type(dynamic.counter, jax.Array)
    assert_type(dynamic.overflows_since_growth, jax.Array)
    assert_type(dynamic.growth_interval, int)
    assert_type(dynamic.growth_factor, float)
    assert_type(dynamic.min_scale, float)
    assert_type(dynamic.skipped_steps, jax.Array)
    assert_type(dynamic.stuck, jax.Array)
    lossscale.DynamicLossScale(scale=8.0, growth_interval=2)
    lossscale.DynamicLossScale(
        jnp.float32(1024),
        counter=0,
        growth_factor=2,
        backoff_factor=0.25,
        min_scale=1,
        max_scale=2.0**20,
        hysteresis=2,
        skipped_steps=jnp.int32(3),
    )
    lossscale.DynamicLossScale()
    static = lossscale.StaticLossScale(1024)
    assert_type(static.value, float)
    assert_type(static.scale, jax.Array)
    assert_type(static.min_scale, float)
    lossscale.StaticLossScale(value=0.5)
    noop = lossscale.NoOpLossScale()
    assert_type(noop.scale, jax.Array)
    assert_type(noop.overflow_leaf, jax.Array)
    assert_type(noop.kind, str)


def any_kind(state: lossscale.LossScale) -> None:
    assert_type(state.scale, jax.Array)
    assert_type(state.skipped_steps, jax.Array)
    assert_type(state.min_scale, float)
    assert_type(state.max_scale, float)
    assert_type(state.replace(skipped_steps=0), lossscale.LossScale)
    assert_type(state.get_config(), dict[str, Any])
    assert_type(lossscale.update(state, jnp.array(True)), lossscale.LossScale)


def same_kind_back(state: lossscale.DynamicLossScale) -> None:
    assert_type(state.replace(scale=jnp.float32(4.0)), lossscale.DynamicLossScale)
    after = lossscale.update(state, jnp.array(False), loss_finite=True)
    assert_type(after, lossscale.DynamicLossScale)
    assert_type(after.counter, jax.Array)
    config = state.get_config()
    assert_type(lossscale.LossScale.from_config(config), lossscale.LossScale)
    assert_type(
        lossscale.DynamicLossScale.from_config(config), lossscale.DynamicLossScale
    )


class AddOne(lossscale.LossScale, kind="typing_test.add_one"):
    """A kind of one's own (docs/guides/custom_kinds.md)."""

    scale: jax.Array = lossscale.field(dtype=jnp.float32, default=8.0)
    floor: float = lossscale.field(static=True, default=1.0)

    def rule(self, grads_finite: jax.Array) -> "AddOne":
        step = jnp.where(grads_finite, 1.0, -1.0)
        return self.replace(scale=jnp.maximum(self.scale + step, self.floor))


def own_kind() -> None:
    state = AddOne(scale=jnp.float32(8.0), floor=2.0)
    AddOne()
    assert_type(state.scale, jax.Array)
    assert_type(state.floor, float)
    assert_type(state.skipped_steps, jax.Array)
    assert_type(lossscale.update(state, jnp.array(True)), AddOne)
