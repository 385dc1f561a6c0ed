"""Flax fp8 layers: `_overwrite_with_gradient` metadata are values, not gradients.

A Flax `Dense` with `Fp8DirectDotGeneralOp` keeps its fp8 scales and amax histories
in the `_overwrite_with_gradient` collection; their "gradients" are their new
values. They must never be unscaled, checked, clipped or fed to the optimizer, be
written only on applied steps (and only where an op produced them), combine with
max under accumulation, and survive a checkpoint.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax.training import train_state as flax_train_state
from helpers import bitwise_equal

import lossscale
import lossscale.flax

# `Fp8DotGeneralOp` quantizes and dequantizes, then multiplies in the compute dtype:
# float16 here. Flax's `Fp8DirectDotGeneralOp` multiplies the fp8 values themselves
# and returns float16 products of up to 448 * 448 before scaling them down, which
# overflow float16 in the forward pass: it needs bfloat16 or float32 compute.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The Fp8DotGeneralOp is deprecated:DeprecationWarning"
)

OWG = "_overwrite_with_gradient"
FP8 = dict(
    dtype=jnp.float16, param_dtype=jnp.float32, dot_general_cls=nn.Fp8DotGeneralOp
)


class Fp8MLP(nn.Module):
    @nn.compact
    def __call__(self, x, use_head=True):
        x = nn.relu(nn.Dense(32, **FP8)(x))
        head = nn.Dense(4, **FP8)
        if use_head or self.is_initializing():
            x = head(x)
        return x


MODEL = Fp8MLP()


def variables():
    return _init(jax.random.key(0), jnp.zeros((1, 8)))


_init = jax.jit(MODEL.init)  # one compile, where op by op Flax's init compiles ~50


def batch(step, overflow=False):
    rng = np.random.default_rng(step)
    x = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((16, 4)), jnp.float32)
    # Far-off targets: a finite float32 loss whose float16 cotangents overflow.
    # (Large inputs would not: fp8 quantization clips them.)
    return x, (y * 1e6 if overflow else y)


def loss_fn(variables, x, y, use_head=True):
    out = MODEL.apply(variables, x, use_head).astype(jnp.float32)
    return jnp.mean((out[:, :4] - y) ** 2)  # without the head: 4 hidden units


@jax.jit
def train_step(state, x, y):
    loss, grads = lossscale.value_and_grad(loss_fn)(state, state.params, x, y)
    return state.apply_gradients(grads=grads), grads


def new_state(**kwargs):
    return lossscale.flax.TrainState.create(
        apply_fn=MODEL.apply,
        params=variables(),
        tx=optax.adam(1e-2),
        loss_scale=lossscale.DynamicLossScale(scale=2.0**8),
        **kwargs,
    )


@jax.jit
def apply_jitted(state, grads):  # one compile, where op by op each leaf's compiles
    return state.apply_gradients(grads=grads)


def test_fp8_metadata_are_written_on_applied_steps_only_and_never_optimised():
    state = new_state()
    # The optimizer never sees the metadata.
    assert OWG not in state.opt_state[0].mu
    reference = flax_train_state.TrainState.create(
        apply_fn=MODEL.apply, params=variables(), tx=optax.adam(1e-2)
    )
    for step in range(6):
        overflow = step == 3
        before = state
        state, grads = train_step(state, *batch(step, overflow))
        if overflow:
            assert bitwise_equal(state.params, before.params)  # metadata included
            assert int(state.step) == int(before.step)
            assert float(state.loss_scale.scale) == float(before.loss_scale.scale) / 2
            continue
        # Metadata: exactly the values the step computed, unscaled by nothing.
        assert bitwise_equal(state.params[OWG], grads[OWG])
        # Parameters: Flax's own TrainState on the unscaled gradients.
        scale = float(before.loss_scale.scale)
        unscaled = {
            "params": jax.tree.map(lambda g, s=scale: g / s, grads["params"]),
            OWG: grads[OWG],
        }
        reference = reference.replace(params=before.params)
        reference = apply_jitted(reference, unscaled)
        for a, b in zip(
            jax.tree.leaves(state.params["params"]),
            jax.tree.leaves(reference.params["params"]),
            strict=True,
        ):
            np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-9)
    assert int(state.step) == 5 and int(state.loss_scale.skipped_steps) == 1
    history = state.params[OWG]["Dense_0"]["Fp8DotGeneralOp_0"]
    assert float(jnp.max(history["input_amax_history"])) > 0  # they did move


def test_an_op_that_did_not_run_keeps_its_metadata_where_flax_zeroes_them():
    state = new_state()
    x, y = batch(0)
    grads = jax.jit(
        jax.grad(lambda v, s: lossscale.scale_loss(loss_fn(v, x, y, False), s))
    )(state.params, state)
    head = grads[OWG]["Dense_1"]["Fp8DotGeneralOp_0"]
    assert float(jnp.max(jnp.abs(head["kernel_scale"]))) == 0.0  # the default
    new = state.apply_gradients(grads=grads)
    old_head = state.params[OWG]["Dense_1"]
    assert bitwise_equal(new.params[OWG]["Dense_1"], old_head)
    assert not bitwise_equal(new.params[OWG]["Dense_0"], state.params[OWG]["Dense_0"])
    # Flax's TrainState writes the default: a kernel scale of 0.
    flax_state = flax_train_state.TrainState.create(
        apply_fn=MODEL.apply, params=state.params, tx=optax.adam(1e-2)
    ).apply_gradients(grads=grads)
    zeroed = flax_state.params[OWG]["Dense_1"]["Fp8DotGeneralOp_0"]
    assert float(zeroed["kernel_scale"][0]) == 0.0


def test_metadata_take_no_part_in_the_check():
    # Flax's max-accumulating fm32 metadata default to -inf when an op did not run:
    # finite gradients with such metadata are applied, and the -inf not written.
    state = new_state()
    x, y = batch(0)
    grads = jax.grad(lambda v: lossscale.scale_loss(loss_fn(v, x, y), state))(
        state.params
    )
    leaf = grads[OWG]["Dense_1"]["Fp8DotGeneralOp_0"]["input_scale"]
    grads[OWG]["Dense_1"]["Fp8DotGeneralOp_0"]["input_scale"] = jnp.full_like(
        leaf, -jnp.inf
    )
    new = state.apply_gradients(grads=grads)
    assert int(new.step) == 1 and int(new.loss_scale.skipped_steps) == 0
    kept = new.params[OWG]["Dense_1"]["Fp8DotGeneralOp_0"]["input_scale"]
    old = state.params[OWG]["Dense_1"]["Fp8DotGeneralOp_0"]["input_scale"]
    assert bitwise_equal(kept, old)


@pytest.mark.parametrize("clip_norm", [None, 1e-3])
def test_apply_gradients_and_wrap_write_the_metadata_too(clip_norm, backend_form):
    params = variables()
    trainable = {"params": params["params"]}
    x, y = batch(1)
    loss_scale = lossscale.DynamicLossScale(scale=2.0**8)
    grads = jax.jit(  # one compile, where op by op the model's grad compiles ~100
        jax.grad(lambda v, s: lossscale.scale_loss(loss_fn(v, x, y), s))
    )(params, loss_scale)
    tx = optax.adam(1e-2)
    new_params, _, _ = jax.jit(
        lambda p, o, g: lossscale.apply_gradients(
            tx,
            grads=g,
            params=p,
            opt_state=o,
            loss_scale=loss_scale,
            clip_norm=clip_norm,
        )
    )(params, tx.init(trainable), grads)
    assert bitwise_equal(new_params[OWG], grads[OWG])

    wrapped = lossscale.wrap(tx, loss_scale, clip_norm=clip_norm)
    state = wrapped.init(params)
    updates, state = jax.jit(wrapped.update)(grads, state, params)
    applied = optax.apply_updates(params, updates)
    # `apply_updates` adds: old + (new - old) is new to within one rounding.
    for a, b in zip(
        jax.tree.leaves(applied[OWG]), jax.tree.leaves(grads[OWG]), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)
    for a, b in zip(
        jax.tree.leaves(applied["params"]),
        jax.tree.leaves(new_params["params"]),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
    # A skipped step writes nothing.
    bad = jax.tree.map(lambda g: g * jnp.inf, grads)
    updates, _ = jax.jit(wrapped.update)(bad, state, applied)
    assert bitwise_equal(optax.apply_updates(applied, updates), applied)


def test_apply_gradients_says_how_to_build_the_optimizer_state():
    # A state built with the fp8 collection breaks the step of an optimizer that
    # reads its state (one that ignores it, as `optax.sgd`, takes any state).
    params = variables()
    tx = optax.adam(0.1)
    with pytest.raises(ValueError, match="no optimizer sees"):
        lossscale.apply_gradients(
            tx,
            grads=params,
            params=params,
            opt_state=optax.adam(0.1).init(params),
            loss_scale=lossscale.NoOpLossScale(),
        )


def _grads_with_history(shape):
    params = variables()
    grads = jax.tree.map(jnp.zeros_like, params)
    ops = grads[OWG]["Dense_0"]["Fp8DotGeneralOp_0"]
    ops["input_amax_history"] = jnp.ones(shape)
    return params, grads


@pytest.mark.parametrize(
    "shape, match",
    [((1,), r"shape \(1,\), the variable has shape \(1024,\)"), ((4, 1024), "4, 1024")],
)
def test_new_fp8_values_of_another_shape_are_refused(shape, match):
    # A (1,) value for a (1024,) history would be broadcast into all of it.
    params, grads = _grads_with_history(shape)
    tx = optax.sgd(0.1)
    where = r"_overwrite_with_gradient\['Dense_0'\]\['Fp8DotGeneralOp_0'\]"
    with pytest.raises(ValueError, match=f"{where}.*{match}"):
        lossscale.apply_gradients(
            tx,
            grads=grads,
            params=params,
            opt_state=tx.init({"params": params["params"]}),
            loss_scale=lossscale.NoOpLossScale(),
        )
    wrapped = lossscale.wrap(tx, None)
    with pytest.raises(ValueError, match=match):
        wrapped.update(grads, wrapped.init(params), params)


@pytest.mark.parametrize("loss_scale", ["dynamic", None], ids=["dynamic", "no-op"])
def test_multisteps_around_wrap_with_fp8_is_refused_at_init(loss_scale):
    # Issue 42, item 9: with a `NoOpLossScale` nothing looks the state up, so
    # the refusal must come at `init`, whatever the kind.
    params = variables()
    tx = optax.MultiSteps(
        lossscale.wrap(optax.sgd(0.1), loss_scale), every_k_schedule=2
    )
    with pytest.raises(ValueError, match="averaging the scales"):
        tx.init(params)
    # Without fp8 variables the order is refused too (tests/test_accumulation.py).
    with pytest.raises(ValueError, match=r"lossscale.wrap\(optax.MultiSteps\(inner"):
        tx.init({"params": params["params"]})
    # Inside the wrap, fp8 variables are accepted.
    inside = lossscale.wrap(optax.MultiSteps(optax.sgd(0.1), 2), loss_scale)
    inside.init(params)


def test_a_restored_multisteps_state_around_wrap_with_fp8_is_refused_on_lookup():
    # A state built another way (restored, say) is still refused where it is read.
    params = variables()
    trainable = {"params": params["params"]}
    plain = optax.MultiStepsState(  # what `MultiSteps(wrap(...)).init` built
        mini_step=jnp.zeros([], jnp.int32),
        gradient_step=jnp.zeros([], jnp.int32),
        inner_opt_state=lossscale.wrap(optax.sgd(0.1)).init(trainable),
        acc_grads=jax.tree.map(jnp.zeros_like, trainable),
        skip_state=(),
    )
    acc = {
        **plain.acc_grads,
        "_overwrite_with_gradient": params["_overwrite_with_gradient"],
    }
    opt_state = plain._replace(acc_grads=acc)
    with pytest.raises(ValueError, match="averaging the scales"):
        lossscale.get_loss_scale(opt_state)


def test_multisteps_outside_wrap_with_fp8_is_refused_and_says_to_wrap_it():
    # Issue 33: `apply_gradients` and the `TrainState` write the metadata on
    # every applied call, so under MultiSteps on every micro-step.
    params = variables()
    tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
    inner = tx.gradient_transformation()
    grads = jax.tree.map(jnp.ones_like, params)
    remedy = r"lossscale.wrap\(optax.MultiSteps\(inner, k\)\)"
    with pytest.raises(ValueError, match=f"every micro-step.*{remedy}"):
        lossscale.apply_gradients(
            inner,
            grads=grads,
            params=params,
            opt_state=inner.init({"params": params["params"]}),
            loss_scale=lossscale.NoOpLossScale(),
        )
    with pytest.raises(ValueError, match=f"every micro-step.*{remedy}"):
        lossscale.flax.TrainState.create(apply_fn=MODEL.apply, params=params, tx=inner)
    # A state built around the check (by the constructor) is refused at the step.
    plain = new_state()
    state = plain.replace(tx=inner, opt_state=inner.init(fp8_free(params)))
    with pytest.raises(ValueError, match=f"every micro-step.*{remedy}"):
        state.apply_gradients(grads=grads)
    # Without fp8 variables, accumulating this way is fine.
    lossscale.apply_gradients(
        inner,
        grads=grads["params"],
        params=params["params"],
        opt_state=inner.init(params["params"]),
        loss_scale=lossscale.NoOpLossScale(),
    )


def fp8_free(params):
    return {k: v for k, v in params.items() if k != OWG}


def test_unscale_grads_leaves_the_fp8_collection_alone():
    params = variables()
    grads = jax.tree.map(lambda p: jnp.full_like(p, 8.0), params)
    unscaled = lossscale.unscale_grads(grads, lossscale.StaticLossScale(8.0))
    assert bitwise_equal(unscaled[OWG], grads[OWG])
    for leaf in jax.tree.leaves(unscaled["params"]):
        np.testing.assert_array_equal(leaf, 1.0)


def test_under_accumulation_metadata_combine_with_max_until_the_optimizer_steps(
    backend_form,
):
    params = variables()
    tx = lossscale.wrap(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2), None)
    state = tx.init(params)
    step = jax.jit(tx.update)

    def grads_with(metadata_value, finite=True):
        grads = jax.tree.map(jnp.zeros_like, params)
        grads[OWG] = jax.tree.map(
            lambda m: jnp.full_like(m, metadata_value), params[OWG]
        )
        if not finite:
            grads["params"]["Dense_0"]["bias"] = (
                grads["params"]["Dense_0"]["bias"].at[0].set(jnp.nan)
            )
        return grads

    current = params
    for value, finite, written in [
        (3.0, True, None),  # first micro-step: held
        (7.0, False, None),  # skipped: not combined
        (5.0, True, 5.0),  # the optimizer steps: max(3, 5) written
        (2.0, True, None),
        (1.0, True, 2.0),
    ]:
        updates, state = step(grads_with(value, finite), state, current)
        new = optax.apply_updates(current, updates)
        if written is None:
            assert bitwise_equal(new[OWG], current[OWG])
        else:
            for leaf in jax.tree.leaves(new[OWG]):
                np.testing.assert_allclose(leaf, written, rtol=1e-6)
        current = new


def test_fp8_training_resumes_from_a_checkpoint_bit_identically(tmp_path):
    schedule = [(step, step == 4) for step in range(8)]
    state = new_state()
    for step, overflow in schedule:
        if step == 5:
            with ocp.CheckpointManager(tmp_path) as manager:
                manager.save(5, args=ocp.args.StandardSave(state))
                manager.wait_until_finished()
        state, _ = train_step(state, *batch(step, overflow))
    with ocp.CheckpointManager(tmp_path) as manager:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, new_state())
        resumed = manager.restore(5, args=ocp.args.StandardRestore(abstract))
    for step, overflow in schedule[5:]:
        resumed, _ = train_step(resumed, *batch(step, overflow))
    assert bitwise_equal(jax.tree.leaves(resumed), jax.tree.leaves(state))
    assert int(state.loss_scale.skipped_steps) == 1
