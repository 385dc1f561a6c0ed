"""Flax integrations: linen TrainState, nnx Optimizer, Orbax checkpoints.

The models compute in float16 with float32 parameters and train on scikit-learn's
digits. Every 40th batch is multiplied by 1e5 so that it overflows float16: those
steps must be skipped exactly.
"""

from typing import Any

import flax.linen as nn
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax import serialization
from flax.training import train_state as flax_train_state
from flax.training.dynamic_scale import DynamicScale
from helpers import LinenMLP
from helpers import bitwise_equal
from helpers import cross_entropy
from helpers import examples
from helpers import linen_state
from helpers import linen_step
from helpers import linen_step_fn
from helpers import restore
from helpers import save
from hypothesis import given
from hypothesis import settings

import lossscale
import lossscale.flax
from lossscale.demo import load_digits

STEPS = 240
BATCH = 128
OVERFLOW_EVERY = 40


@pytest.fixture(scope="module")
def digits():
    (x_train, y_train), (x_test, y_test) = load_digits(0)
    return jnp.asarray(x_train), jnp.asarray(y_train), x_test, y_test


def batches(digits, steps=STEPS):
    x, y = digits[0], digits[1]
    rng = np.random.default_rng(1)
    for step in range(steps):
        index = rng.choice(len(x), BATCH, replace=False)
        xb = x[index]
        forced = step % OVERFLOW_EVERY == OVERFLOW_EVERY // 2
        if forced:
            xb = xb * 1e5  # inf once cast to float16
        yield step, forced, xb, y[index]


# -- linen ---------------------------------------------------------------------


def linen_accuracy(state, x, y):
    logits = state.apply_fn({"params": state.params}, jnp.asarray(x))
    return float(np.mean(np.argmax(np.asarray(logits), -1) == y))


@pytest.mark.slow  # a training run
def test_linen_train_state_trains_in_float16_and_skips_exactly(digits):
    # A function of its own, so a cache of its own: other tests share `linen_step`.
    step = jax.jit(lambda state, x, y: linen_step_fn(state, x, y))
    state = linen_state()
    first_loss = None
    applied = 0
    for _, forced, x, y in batches(digits):
        before = state
        state, loss = step(state, x, y)
        first_loss = first_loss if first_loss is not None else float(loss)
        finite = bool(lossscale.metrics(state)["last_finite"])
        applied += finite
        if forced:
            assert not finite
        if not finite:
            assert bitwise_equal(state.params, before.params)
            assert bitwise_equal(state.opt_state, before.opt_state)
            assert int(state.step) == int(before.step)
            assert float(state.loss_scale.scale) == max(
                float(before.loss_scale.scale) / 2, 1.0
            )
    assert step._cache_size() == 1
    assert state.step.dtype == jnp.int32
    assert int(state.step) == applied == int(state.opt_state[0].count)
    skipped = int(state.loss_scale.skipped_steps)
    assert skipped == STEPS - applied >= STEPS // OVERFLOW_EVERY
    assert float(loss) < 0.25 * first_loss
    assert linen_accuracy(state, digits[2], digits[3]) > 0.9


def test_linen_applied_step_is_the_optimizer_step_on_unscaled_gradients(digits):
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    state = linen_state(lossscale.StaticLossScale(1024), tx)
    plain = flax_train_state.TrainState.create(
        apply_fn=state.apply_fn, params=state.params, tx=tx
    )
    _, _, x, y = next(batches(digits))

    def loss_fn(params):
        return cross_entropy(state.apply_fn({"params": params}, x), y)

    grads = jax.jit(jax.grad(lambda p: lossscale.scale_loss(loss_fn(p), state)))(
        state.params
    )
    new = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, grads)
    expected = jax.jit(lambda s, g: s.apply_gradients(grads=g))(
        plain, lossscale.unscale_grads(grads, lossscale.StaticLossScale(1024))
    )
    # A few ulp at most: XLA may contract the unscale multiply into an FMA.
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8),
        (new.params, new.opt_state),
        (expected.params, expected.opt_state),
    )
    assert int(new.step) == 1


def test_linen_skip_keeps_negative_zero_parameters_bitwise():
    state = lossscale.flax.TrainState.create(
        apply_fn=None, params={"w": jnp.array([-0.0, 0.0, 1.0])}, tx=optax.sgd(0.1)
    )
    new = state.apply_gradients(grads={"w": jnp.array([jnp.nan, 1.0, 1.0])})
    assert bitwise_equal(new.params, state.params)


def test_linen_train_state_refuses_bad_input():
    with pytest.raises(ValueError, match="wrapped with `lossscale.wrap` already"):
        linen_state(tx=lossscale.wrap(optax.adam(1e-3)))
    with pytest.raises(TypeError, match="`tx` must be an optax transformation"):
        lossscale.flax.TrainState.create(apply_fn=None, params={}, tx="adam")
    with pytest.raises(ValueError, match="'dynamic'"):
        linen_state(loss_scale="dynamc")
    state = lossscale.flax.TrainState.create(
        apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1)
    )
    with pytest.raises(ValueError, match="same tree structure"):
        state.apply_gradients(grads={"v": jnp.ones(2)})
    with pytest.raises(TypeError, match="floating-point"):
        state.apply_gradients(grads={"w": jnp.ones(2, jnp.int32)})
    with pytest.raises(ValueError, match="fp8"):
        state.apply_gradients(grads={"_overwrite_with_gradient": {}, "w": 1.0})


# -- nnx -----------------------------------------------------------------------


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        dense = dict(dtype=jnp.float16, param_dtype=jnp.float32, rngs=rngs)
        self.layers = nnx.List(
            [nnx.Linear(64, 128, **dense), nnx.Linear(128, 128, **dense)]
        )
        self.head = nnx.Linear(128, 10, **dense)

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return self.head(x)


@nnx.jit
def nnx_step(model, optimizer, x, y):
    def loss_fn(model):
        loss = cross_entropy(model(x), y)
        return lossscale.scale_loss(loss, optimizer), loss

    (_, loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss


@pytest.mark.slow  # a training run
def test_nnx_optimizer_trains_in_float16_and_skips_exactly(digits):
    model = NnxMLP(nnx.Rngs(0))
    optimizer = lossscale.flax.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    first_loss = None
    applied = 0
    for _, forced, x, y in batches(digits):
        params_before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
        inner_before = jax.tree.map(jnp.copy, nnx.as_pure(optimizer.opt_state))
        step_before = int(optimizer.step[...])
        scale_before = float(optimizer.loss_scale.scale)
        loss = nnx_step(model, optimizer, x, y)
        first_loss = first_loss if first_loss is not None else float(loss)
        finite = bool(lossscale.metrics(optimizer)["last_finite"])
        applied += finite
        if forced:
            assert not finite
        if not finite:
            assert bitwise_equal(nnx.state(model, nnx.Param), params_before)
            inner_after = nnx.as_pure(optimizer.opt_state).inner_state
            assert bitwise_equal(inner_after, inner_before.inner_state)
            assert int(optimizer.step[...]) == step_before
            assert float(optimizer.loss_scale.scale) == max(scale_before / 2, 1.0)
    adam_count = nnx.as_pure(optimizer.opt_state).inner_state[0].count
    assert int(optimizer.step[...]) == applied == int(adam_count)
    assert int(optimizer.loss_scale.skipped_steps) == STEPS - applied
    assert applied <= STEPS - STEPS // OVERFLOW_EVERY
    assert float(loss) < 0.25 * first_loss
    logits = model(jnp.asarray(digits[2]))
    assert np.mean(np.argmax(np.asarray(logits), -1) == digits[3]) > 0.9


def test_plain_nnx_optimizer_around_wrap_counts_skipped_steps_which_ours_does_not():
    # Why `lossscale.flax.Optimizer` exists: `nnx.Optimizer` always counts a step.
    def run(optimizer_cls, tx):
        model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        optimizer = optimizer_cls(model, tx, wrt=nnx.Param)
        grads = nnx.grad(lambda m: jnp.sum(m(jnp.full((1, 2), jnp.inf))))(model)
        optimizer.update(model, grads)
        return int(optimizer.step[...])

    assert run(nnx.Optimizer, lossscale.wrap(optax.sgd(0.1))) == 1
    assert run(lossscale.flax.Optimizer, optax.sgd(0.1)) == 0


def test_nnx_optimizer_refuses_a_wrapped_tx():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="wrapped already"):
        lossscale.flax.Optimizer(model, lossscale.wrap(optax.sgd(0.1)), wrt=nnx.Param)


# -- Orbax checkpoints ---------------------------------------------------------


def test_resuming_from_a_checkpoint_is_bit_identical(digits, tmp_path):
    loss_scale = lossscale.DynamicLossScale(scale=2.0**15, growth_interval=7)
    stop = 60
    state = linen_state(loss_scale)
    schedule = list(batches(digits, 120))
    for step, _, x, y in schedule:
        if step == stop:
            save(tmp_path, step, state)
        state, _ = linen_step(state, x, y)

    resumed = restore(tmp_path, stop, linen_state(loss_scale))
    assert int(resumed.step) <= stop
    for _, _, x, y in schedule[stop:]:
        resumed, _ = linen_step(resumed, x, y)

    # `tx` is a new (equal, not identical) optimizer, so compare the arrays.
    assert bitwise_equal(jax.tree.leaves(resumed), jax.tree.leaves(state))
    # The scale moved after the checkpoint, so the loss-scale state was restored,
    # not re-created.
    assert int(state.loss_scale.skipped_steps) >= 2
    assert resumed.loss_scale.get_config() == loss_scale.get_config()


@pytest.mark.parametrize(
    "written, restored, error",
    [
        ("dynamic", 1024.0, "tree structures do not match"),
        ("dynamic", None, "tree structures do not match"),
        (1024.0, None, "kind: checkpoint 'static', code 'none'"),
        (1024.0, 512.0, "value: checkpoint 1024.0, code 512.0"),
        ("dynamic", lossscale.DynamicLossScale(hysteresis=2), "hysteresis"),
    ],
)
def test_restoring_with_another_loss_scale_is_an_error(
    tmp_path, written, restored, error
):
    save(tmp_path, 0, linen_state(written))
    target = linen_state(restored)
    with pytest.raises(ValueError, match=error):
        # The config check catches what the arrays cannot show; Orbax's own
        # structure check catches the rest even without the config.
        if "structures" in error:
            with ocp.CheckpointManager(tmp_path) as manager:
                abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
                manager.restore(
                    0,
                    args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)),
                )
        else:
            restore(tmp_path, 0, target)


def test_a_plain_flax_checkpoint_does_not_restore_silently(tmp_path):
    model = LinenMLP()
    params = model.init(jax.random.key(0), jnp.zeros((1, 64)))["params"]
    plain = flax_train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.adam(1e-3)
    )
    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave(plain)))
        manager.wait_until_finished()
    with pytest.raises(ValueError, match="tree structures do not match"):
        with ocp.CheckpointManager(tmp_path) as manager:
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, linen_state())
            manager.restore(
                0, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
            )


def test_migrating_a_checkpoint_to_another_loss_scale(tmp_path):
    old = linen_state(1024.0)
    save(tmp_path, 0, old)
    with ocp.CheckpointManager(tmp_path) as manager:
        saved = manager.restore(
            0, args=ocp.args.Composite(loss_scale=ocp.args.JsonRestore())
        ).loss_scale
    as_written = linen_state(lossscale.LossScale.from_config(saved))
    restored = restore(tmp_path, 0, as_written)
    migrated = restored.replace(loss_scale=lossscale.DynamicLossScale())
    assert bitwise_equal(migrated.params, old.params)
    assert migrated.loss_scale.get_config() == lossscale.DynamicLossScale().get_config()


# -- Flax's own patterns: extra fields, `value=`, skipped steps keep everything ----


class BatchNormMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Dense(8, dtype=jnp.float16, param_dtype=jnp.float32)(x)
        x = nn.BatchNorm(use_running_average=not train, dtype=jnp.float16)(x)
        return nn.Dense(1, dtype=jnp.float16, param_dtype=jnp.float32)(nn.relu(x))


class BatchStatsState(lossscale.flax.TrainState):
    # Flax's ImageNet example: a field without a default, after the base's fields.
    batch_stats: Any


def batch_norm_state():
    variables = BatchNormMLP().init(jax.random.key(0), jnp.ones((4, 3)))
    return BatchStatsState.create(
        apply_fn=BatchNormMLP().apply,
        params=variables["params"],
        tx=optax.adam(1e-2),
        batch_stats=variables["batch_stats"],
        loss_scale=lossscale.DynamicLossScale(scale=2.0**8),
    )


@jax.jit
def batch_norm_step(state, x):
    def loss_fn(params):
        out, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            x,
            mutable=["batch_stats"],
        )
        return jnp.mean(out.astype(jnp.float32) ** 2), updates

    (loss, updates), grads = lossscale.value_and_grad(loss_fn, has_aux=True)(
        state, state.params
    )
    return state.apply_gradients(
        grads=grads, value=loss, batch_stats=updates["batch_stats"]
    )


def test_a_subclass_with_batch_stats_trains_and_a_forward_overflow_keeps_them():
    state = batch_norm_state()
    x = jax.random.normal(jax.random.key(1), (16, 3))
    state = batch_norm_step(state, x)
    assert int(state.step) == 1
    moved = jax.tree.leaves(state.batch_stats)
    # Inputs that overflow float16 in the forward pass: the statistics of this
    # batch are inf/NaN, and a skipped step must not write them.
    before = state
    state = batch_norm_step(state, x.at[0].set(1e6))
    assert int(state.step) == 1
    assert int(state.loss_scale.forward_overflows) == 1
    assert float(state.loss_scale.scale) == float(before.loss_scale.scale)  # kept
    assert bitwise_equal(state.batch_stats, before.batch_stats)
    assert bitwise_equal(state.params, before.params)
    for leaf in jax.tree.leaves(state.batch_stats):
        assert np.isfinite(np.asarray(leaf)).all()
    state = batch_norm_step(state, x)  # and it trains on
    assert int(state.step) == 2
    assert not bitwise_equal(jax.tree.leaves(state.batch_stats), moved)


def test_a_field_whose_tree_changes_cannot_be_kept_and_says_so():
    state = batch_norm_state()
    grads = jax.tree.map(jnp.zeros_like, state.params)
    with pytest.raises(ValueError, match="`apply_gradients\\(batch_stats=...\\)`"):
        state.apply_gradients(grads=grads, batch_stats={"other": jnp.ones(2)})


def test_a_misspelt_field_is_a_type_error_naming_it_as_flax_raises():
    variables = BatchNormMLP().init(jax.random.key(0), jnp.ones((4, 3)))
    with pytest.raises(TypeError, match="`batch_stat`.*did you mean `batch_stats`"):
        BatchStatsState.create(
            apply_fn=BatchNormMLP().apply,
            params=variables["params"],
            tx=optax.adam(1e-2),
            batch_stat=variables["batch_stats"],
        )
    # Issue 33: `apply_gradients` raised `AttributeError` from `getattr`.
    state = batch_norm_state()
    grads = jax.tree.map(jnp.zeros_like, state.params)
    with pytest.raises(TypeError, match="`batch_stat`.*did you mean `batch_stats`"):
        state.apply_gradients(grads=grads, batch_stat=state.batch_stats)
    # Flax's own TrainState raises a TypeError too (for the constructor's keyword).
    plain = flax_train_state.TrainState.create(
        apply_fn=None, params=state.params, tx=optax.adam(1e-2)
    )
    with pytest.raises(TypeError, match="batch_stat"):
        plain.apply_gradients(grads=grads, batch_stat={})


def test_fields_the_train_state_computes_are_refused_as_keywords():
    state = batch_norm_state()
    grads = jax.tree.map(jnp.zeros_like, state.params)
    for name in ("step", "params", "opt_state", "loss_scale"):
        with pytest.raises(TypeError, match=f"computes `{name}` itself"):
            state.apply_gradients(grads=grads, **{name: getattr(state, name)})
    with pytest.raises(TypeError, match="computes `step` itself"):
        lossscale.flax.TrainState.create(
            apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1), step=3
        )


def test_an_optax_multisteps_object_says_to_pass_its_transformation():
    multi = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    with pytest.raises(TypeError, match=r"pass `tx.gradient_transformation\(\)`"):
        lossscale.flax.TrainState.create(
            apply_fn=None, params={"w": jnp.ones(2)}, tx=multi
        )
    state = lossscale.flax.TrainState.create(
        apply_fn=None, params={"w": jnp.ones(2)}, tx=multi.gradient_transformation()
    )
    assert int(state.apply_gradients(grads={"w": jnp.ones(2)}).step) == 1


def test_nnx_optimizer_near_misses_say_what_to_write():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="`sgd` is a factory: call it"):
        lossscale.flax.Optimizer(model, optax.sgd, wrt=nnx.Param)
    with pytest.raises(TypeError, match="the class `DynamicLossScale`.*an instance"):
        lossscale.flax.Optimizer(
            model, optax.sgd(0.1), wrt=nnx.Param, loss_scale=lossscale.DynamicLossScale
        )


def test_a_spec_put_in_place_of_the_state_is_a_clear_error():
    state = batch_norm_state().replace(loss_scale="dynamic")
    grads = jax.tree.map(jnp.zeros_like, state.params)
    with pytest.raises(TypeError, match="`loss_scale` must be a loss-scale state"):
        state.apply_gradients(grads=grads)
    tx = lossscale.wrap(optax.sgd(0.1))
    opt_state = tx.init(jnp.ones(2))._replace(loss_scale=1024.0)
    with pytest.raises(TypeError, match="`state.loss_scale` must be a loss-scale"):
        tx.update(jnp.ones(2), opt_state, jnp.ones(2))


@settings(max_examples=examples(25))
@given(
    flags=st.lists(st.booleans(), min_size=1, max_size=40),
    growth_interval=st.integers(1, 4),
)
def test_the_migration_pages_settings_reproduce_flax_dynamic_scale(
    flags, growth_interval
):
    flax_scale = DynamicScale(growth_interval=growth_interval)
    ours = lossscale.DynamicLossScale(
        scale=2.0**16,
        growth_interval=growth_interval + 1,
        min_scale=float(np.finfo(np.float32).tiny),
        max_scale=float(np.finfo(np.float32).max),
    )
    grad_fn = jax.jit(
        lambda d, bad: d.value_and_grad(lambda w: jnp.sum(w * bad))(jnp.ones(2))
    )
    for finite in flags:
        flax_scale, is_finite, _, _ = grad_fn(
            flax_scale, jnp.float32(1.0 if finite else jnp.inf)
        )
        assert bool(is_finite) == finite
        ours = ADJUST(ours, jnp.asarray(finite))
        assert float(ours.scale) == float(flax_scale.scale)


ADJUST = jax.jit(lossscale.update)


class Stepping(lossscale.LossScale, kind="tests.flax_stepping"):
    scale: jax.Array = lossscale.field(dtype=jnp.float32, default=8.0)
    history: jax.Array = lossscale.field(dtype=jnp.bool_, shape=(3,), default=False)
    step_size: float = lossscale.field(static=True, default=1.0)

    def rule(self, grads_finite):
        return self.replace(
            scale=self.scale + jnp.where(grads_finite, self.step_size, -1.0),
            history=jnp.concatenate([self.history[1:], grads_finite[None]]),
        )


@pytest.mark.parametrize(
    "make",
    [
        lossscale.NoOpLossScale,
        lambda: lossscale.StaticLossScale(4.0),
        lambda: lossscale.DynamicLossScale(growth_interval=3, hysteresis=2),
        lambda: Stepping(step_size=2.0),  # defined after `lossscale.flax` was imported
    ],
)
def test_flax_serialization_round_trips_every_kind_and_the_train_state(make):
    state = lossscale.flax.TrainState.create(
        apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.adam(0.1), loss_scale=make()
    )
    for grads in [jnp.full(2, jnp.inf), jnp.ones(2), jnp.full(2, jnp.nan)]:
        state = state.apply_gradients(grads={"w": grads})
    target = lossscale.flax.TrainState.create(
        apply_fn=None, params={"w": jnp.zeros(2)}, tx=optax.adam(0.1), loss_scale=make()
    )
    restored = serialization.from_bytes(target, serialization.to_bytes(state))
    assert restored.loss_scale == state.loss_scale
    assert bitwise_equal(restored.params, state.params)
    assert bitwise_equal(restored.opt_state, state.opt_state)
    assert serialization.to_state_dict(state.loss_scale).keys() == set(
        type(state.loss_scale)._leaves
    )
    # And it steps on from there as the original does.
    a = state.apply_gradients(grads={"w": jnp.ones(2)})
    b = restored.apply_gradients(grads={"w": jnp.ones(2)})
    assert a.loss_scale == b.loss_scale and bitwise_equal(a.params, b.params)


def test_a_state_dict_of_another_layout_is_refused_with_the_way_out():
    target = lossscale.DynamicLossScale()
    with pytest.raises(ValueError, match="int32_fields.*lossscale.checkpoints.upgrade"):
        serialization.from_state_dict(target, {"int32_fields": np.zeros(6)})
