"""`apply_gradients`: the whole step in one cond, equal to `wrap` + `apply_updates`."""

import functools

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import compiled_costs
from helpers import cond_floor_costs
from helpers import grads_like
from helpers import hlo_instructions
from helpers import params_tree
from helpers import tree_equal
from hypothesis import given

import lossscale
import lossscale.flax

SPECS = {
    "none": None,
    "static": 8.0,
    "dynamic": lossscale.DynamicLossScale(scale=4.0, growth_interval=2),
}
INNERS = {
    "adam": lambda: optax.adam(1e-2),
    "clip+adam": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)),
}


@functools.cache
def steps(spec, inner, dtype):
    tx = INNERS[inner]()
    wrapped = lossscale.wrap(tx, SPECS[spec])

    @jax.jit
    def wrap_step(params, opt_state, grads, value):
        updates, opt_state = wrapped.update(grads, opt_state, params, value=value)
        return optax.apply_updates(params, updates), opt_state

    @jax.jit
    def one_call_step(params, opt_state, grads, value):
        params, inner_state, loss_scale = lossscale.apply_gradients(
            tx,
            grads=grads,
            params=params,
            opt_state=opt_state.inner_state,
            loss_scale=opt_state.loss_scale,
            value=value,
        )
        return params, lossscale.WrapState(loss_scale, inner_state)

    return wrapped, wrap_step, one_call_step


EVENTS = st.sampled_from(["finite", "inf", "nan", "huge", "forward"])


@given(
    spec=st.sampled_from(sorted(SPECS)),
    inner=st.sampled_from(sorted(INNERS)),
    dtype=st.sampled_from(["float32", "float16"]),
    events=st.lists(EVENTS, min_size=1, max_size=8),
)
def test_takes_the_same_steps_as_wrap_then_apply_updates(spec, inner, dtype, events):
    wrapped, wrap_step, one_call_step = steps(spec, inner, dtype)
    params = params_tree()
    opt_state = wrapped.init(params)
    for seed, event in enumerate(events):
        bad = {"inf": np.inf, "nan": np.nan, "huge": 6e4}.get(event)
        grads = grads_like(params, seed, scale=3.0, bad=bad)
        grads = jax.tree.map(lambda g: g.astype(dtype), grads)
        value = jnp.float32(np.inf if event == "forward" else 1.0)
        ours = one_call_step(params, opt_state, grads, value)
        params_ref, state_ref = wrap_step(params, opt_state, grads, value)
        # The same decision, and so the same loss-scale state, bit for bit.
        assert tree_equal(ours[1].loss_scale, state_ref.loss_scale), (seed, event)
        if bool(lossscale.metrics(state_ref)["last_finite"]):
            # The same arithmetic, fused differently by XLA: equal to 1 ulp.
            for a, b in zip(
                jax.tree.leaves(ours),
                jax.tree.leaves((params_ref, state_ref)),
                strict=True,
            ):
                np.testing.assert_allclose(a, b, rtol=2.5e-7, atol=0)
            assert not tree_equal(ours[0], params)
        else:
            assert tree_equal(
                (ours[0], ours[1].inner_state), (params, opt_state.inner_state)
            )
        params, opt_state = params_ref, state_ref


def test_forward_overflow_skips_without_backing_off():
    tx = optax.sgd(0.1)
    params = params_tree()
    loss_scale = lossscale.DynamicLossScale(scale=64.0)
    grads = grads_like(params, 0)
    new_params, opt_state, new_scale = lossscale.apply_gradients(
        tx,
        grads=grads,
        params=params,
        opt_state=tx.init(params),
        loss_scale=loss_scale,
        value=jnp.float32(np.nan),
    )
    assert tree_equal(new_params, params)
    assert float(new_scale.scale) == 64.0
    assert int(new_scale.forward_overflows) == 1
    assert int(new_scale.skipped_steps) == 1
    # A backward overflow with a finite loss backs off.
    grads["b"] = grads["b"].at[0].set(jnp.inf)
    _, _, new_scale = lossscale.apply_gradients(
        tx,
        grads=grads,
        params=params,
        opt_state=opt_state,
        loss_scale=loss_scale,
        value=jnp.float32(1.0),
    )
    assert float(new_scale.scale) == 32.0
    assert int(new_scale.forward_overflows) == 0


def test_extra_arguments_and_value_reach_the_transformation():
    seen = {}

    def update(updates, state, params=None, *, value, lr_scale):
        seen.update(value=value, lr_scale=lr_scale)
        return jax.tree.map(lambda g: -lr_scale * g, updates), state

    tx = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
    params = {"w": jnp.ones(3)}
    new_params, _, _ = lossscale.apply_gradients(
        tx,
        grads={"w": jnp.full(3, 8.0)},
        params=params,
        opt_state=tx.init(params),
        loss_scale=lossscale.StaticLossScale(8.0),
        value=jnp.float32(2.5),
        lr_scale=jnp.float32(0.5),
    )
    np.testing.assert_array_equal(new_params["w"], np.full(3, 0.5))
    assert float(seen["value"]) == 2.5 and float(seen["lr_scale"]) == 0.5


@pytest.mark.parametrize("spec", ["none", "static", "dynamic"])
def test_compiles_once_without_host_transfer(spec):
    tx = optax.adam(1e-3)

    chex.clear_trace_counter()  # counted by source: parameters share it

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(params, opt_state, loss_scale, grads):
        return lossscale.apply_gradients(
            tx, grads=grads, params=params, opt_state=opt_state, loss_scale=loss_scale
        )

    params = params_tree()
    loss_scale = lossscale.wrap(tx, SPECS[spec]).init(params).loss_scale
    state = (params, tx.init(params), loss_scale)
    for seed, bad in enumerate([None, np.inf, None, np.nan, None]):
        state = step(*state, grads_like(params, seed, bad=bad))
    assert step._cache_size() == 1
    assert int(state[2].skipped_steps) == 2
    opcodes = {
        opcode
        for opcode, text in hlo_instructions(
            step.lower(*state, grads_like(params, 0)).compile().as_text()
        )
        if opcode in {"infeed", "outfeed", "send", "recv"}
        or (opcode == "custom-call" and "callback" in text.lower())
    }
    assert not opcodes


def one_call_costs(params, grads, clip_norm=None):
    tx = optax.adam(1e-3)

    def step(params, opt_state, loss_scale, grads):
        return lossscale.apply_gradients(
            tx,
            grads=grads,
            params=params,
            opt_state=opt_state,
            loss_scale=loss_scale,
            clip_norm=clip_norm,
        )

    compiled = (
        jax.jit(step, donate_argnums=(0, 1, 2))
        .lower(params, tx.init(params), lossscale.DynamicLossScale(), grads)
        .compile()
    )
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return cost["bytes accessed"], compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's figures")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_costs_one_extra_read_of_the_gradients_in_xla_bytes(dtype):
    # Plain Adam reads grads, params, mu, nu and writes params, mu, nu (about 7
    # gradient-sized float32 trees plus the grads); one more read of the
    # gradients is about 1.10x (float32). XLA:CPU checks a float16 leaf by a
    # mask of one byte per element, written and read back (docs/design.md,
    # "Checking finiteness"): the bytes of two reads, and the mask as temp.
    params = {f"p{i}": jnp.ones((20_000 + 1000 * i,), jnp.float32) for i in range(8)}
    grads = jax.tree.map(lambda p: (p * 1e-3).astype(dtype), params)
    plain_bytes, _ = compiled_costs(optax.adam(1e-3), params, grads)
    ours, temp = one_call_costs(params, grads)
    reads = 1 if jnp.dtype(dtype).itemsize == 4 else 2
    extra_read = sum(g.nbytes for g in jax.tree.leaves(grads))
    # Or no more than a bare check and cond around Adam on this XLA, where that
    # costs more (jax 0.6's copies a gradient tree across the cond).
    floor, floor_temp = cond_floor_costs(params, grads)
    bound = max(plain_bytes + reads * extra_read * 1.1, floor + 0.05 * extra_read)
    assert ours <= bound, (ours / plain_bytes, floor / plain_bytes, dtype)
    mask = 0 if dtype == "float32" else extra_read // jnp.dtype(dtype).itemsize
    temp_bound = max(mask + 0.05 * extra_read, floor_temp + mask + 4096)
    assert temp <= temp_bound, (temp, mask, floor_temp, extra_read)


def _sgd_arguments():
    """SGD, a one-leaf tree and `apply_gradients`' keyword arguments, all correct."""
    tx = optax.sgd(0.1)
    params = {"w": jnp.ones(2)}
    good = dict(
        grads={"w": jnp.ones(2)},
        params=params,
        opt_state=tx.init(params),
        loss_scale=lossscale.DynamicLossScale(),
    )
    return tx, params, good


def test_bad_arguments_are_refused_with_their_names():
    tx, params, good = _sgd_arguments()
    with pytest.raises(TypeError, match="`tx` must be an optax transformation"):
        lossscale.apply_gradients(lambda g: g, **good)
    with pytest.raises(TypeError, match="`loss_scale` must be a loss-scale state"):
        lossscale.apply_gradients(tx, **{**good, "loss_scale": "dynamic"})
    with pytest.raises(TypeError, match="`axis_name`"):
        lossscale.apply_gradients(tx, **good, axis_name=["data"])
    with pytest.raises(ValueError, match="wrapped with `lossscale.wrap` already"):
        wrapped = lossscale.wrap(tx)
        lossscale.apply_gradients(
            wrapped, **{**good, "opt_state": wrapped.init(params)}
        )
    with pytest.raises(ValueError, match="same tree structure"):
        lossscale.apply_gradients(tx, **{**good, "grads": {"v": jnp.ones(2)}})
    with pytest.raises(TypeError, match="floating-point"):
        lossscale.apply_gradients(tx, **{**good, "grads": {"w": jnp.ones(2, int)}})
    with pytest.raises(TypeError, match="`value` must be"):
        lossscale.apply_gradients(tx, **good, value="loss")


def test_an_opt_state_not_from_tx_init_is_refused_naming_where_it_differs():
    tx = optax.adam(1e-3)
    params = {"w": jnp.ones(2)}
    good = dict(
        grads={"w": jnp.ones(2)},
        params=params,
        loss_scale=lossscale.DynamicLossScale(),
    )
    # Before: `AttributeError: 'EmptyState' object has no attribute 'mu'`, a
    # `len()` of None, or a tree-prefix error deep inside optax.
    for opt_state, where in [
        (optax.sgd(0.1).init(params), "0 leaves where `tx.init"),
        (None, "0 leaves where `tx.init"),
        (tx.init({"v": jnp.ones(2)}), r"`opt_state\[0\].mu\['v'\]`"),
    ]:
        with pytest.raises(ValueError, match=f"must be `tx.init\\(params\\)`.*{where}"):
            lossscale.apply_gradients(tx, opt_state=opt_state, **good)
    # A state carried from step to step is, of course, accepted.
    step = jax.jit(functools.partial(lossscale.apply_gradients, tx))
    opt_state = tx.init(params)
    for _ in range(2):
        params, opt_state, _ = step(**{**good, "params": params}, opt_state=opt_state)


def test_near_misses_of_tx_and_loss_scale_say_what_to_write():
    tx, params, good = _sgd_arguments()
    with pytest.raises(TypeError, match="`sgd` is a factory: call it"):
        lossscale.apply_gradients(optax.sgd, **good)
    multi = optax.MultiSteps(tx, every_k_schedule=2)
    with pytest.raises(TypeError, match=r"pass `tx.gradient_transformation\(\)`"):
        lossscale.apply_gradients(multi, **good)
    with pytest.raises(TypeError, match="the class `DynamicLossScale`.*an instance"):
        lossscale.apply_gradients(
            tx, **{**good, "loss_scale": lossscale.DynamicLossScale}
        )


@pytest.mark.parametrize("path", ["wrap", "apply_gradients"])
@pytest.mark.parametrize("grad_dtype", ["float16", "bfloat16"])
def test_narrow_gradients_of_wide_params_are_unscaled_without_underflow(
    path, grad_dtype
):
    # 2**-6 under a scale of 2**24 is 2**-30: below float16's smallest subnormal
    # (2**-24), so unscaling into float16 would give 0. Into the float32 parameter's
    # dtype it is exact, and SGD(1) moves the parameter by exactly that.
    scale = lossscale.StaticLossScale(2.0**24)
    params = {"w": jnp.zeros(3, jnp.float32), "h": jnp.zeros(2, jnp.float16)}
    grads = {
        "w": jnp.full(3, 2.0**-6, grad_dtype),
        "h": jnp.full(2, 2.0**-6, jnp.float16),
    }
    tx = optax.sgd(1.0)
    if path == "wrap":
        wrapped = lossscale.wrap(tx, scale)
        updates, _ = wrapped.update(grads, wrapped.init(params), params)
        new_params = optax.apply_updates(params, updates)
    else:
        new_params, _, _ = lossscale.apply_gradients(
            tx, grads=grads, params=params, opt_state=tx.init(params), loss_scale=scale
        )
    np.testing.assert_array_equal(new_params["w"], np.full(3, -(2.0**-30), np.float32))
    # A float16 parameter's gradient stays float16, and the value underflows.
    assert new_params["h"].dtype == jnp.float16
    np.testing.assert_array_equal(new_params["h"], np.zeros(2, np.float16))


# -- clip_norm: clipping in the finiteness check's pass -----------------------------


def run_clipped(path, clip_norm, loss_scale, grads, params):
    """One step of `path` with `clip_norm`, or with optax's clip in the chain."""
    adam = optax.adam(1e-2)
    chain = optax.chain(optax.clip_by_global_norm(clip_norm), optax.adam(1e-2))
    if path == "wrap":
        ours = lossscale.wrap(adam, loss_scale, clip_norm=clip_norm)
        theirs = lossscale.wrap(chain, loss_scale)
        out = []
        for tx in (ours, theirs):
            state = tx.init(params)
            updates, state = tx.update(grads, state, params)
            out.append((optax.apply_updates(params, updates), state.loss_scale))
        return out
    if path == "apply_gradients":
        state = lossscale.wrap(adam, loss_scale).init(params).loss_scale
        ours = lossscale.apply_gradients(
            adam,
            grads=grads,
            params=params,
            opt_state=adam.init(params),
            loss_scale=state,
            clip_norm=clip_norm,
        )
        theirs = lossscale.apply_gradients(
            chain,
            grads=grads,
            params=params,
            opt_state=chain.init(params),
            loss_scale=state,
        )
        return [(ours[0], ours[2]), (theirs[0], theirs[2])]
    out = []
    for tx, clip in ((adam, clip_norm), (chain, None)):
        state = lossscale.flax.TrainState.create(
            apply_fn=None, params=params, tx=tx, loss_scale=loss_scale, clip_norm=clip
        ).apply_gradients(grads=grads)
        out.append((state.params, state.loss_scale))
    return out


@pytest.mark.parametrize("path", ["wrap", "apply_gradients", "TrainState"])
@pytest.mark.parametrize("scale", [1.0, 2.0**12, 2.0**20])
@pytest.mark.parametrize("clip_norm", [0.1, 1e3])
def test_clip_norm_matches_optax_clip_by_global_norm_first(path, scale, clip_norm):
    params = params_tree()
    grads = grads_like(params, 3, scale=scale)
    (ours, our_scale), (theirs, their_scale) = run_clipped(
        path, clip_norm, lossscale.StaticLossScale(scale), grads, params
    )
    assert tree_equal(our_scale, their_scale)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert not tree_equal(ours, params)


@pytest.mark.parametrize("path", ["wrap", "apply_gradients", "TrainState"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_clip_norm_skips_non_finite_gradients(path, bad):
    params = params_tree()
    grads = grads_like(params, 4, bad=bad)
    (ours, our_scale), (_, their_scale) = run_clipped(
        path, 1.0, lossscale.DynamicLossScale(scale=8.0), grads, params
    )
    assert tree_equal(ours, params)
    assert tree_equal(our_scale, their_scale)
    assert float(our_scale.scale) == 4.0


def test_clip_norm_takes_an_overflow_of_the_squares_for_a_gradient_overflow():
    # 1e20 squared overflows float32: the step is skipped and the scale backs off,
    # which shrinks the scaled gradients until their squares fit again.
    params = {"w": jnp.zeros(2)}
    grads = {"w": jnp.asarray([1e20, 0.0], jnp.float32)}
    tx = optax.sgd(1.0)
    loss_scale = lossscale.DynamicLossScale(scale=2.0**15)
    new_params, _, loss_scale = lossscale.apply_gradients(
        tx,
        grads=grads,
        params=params,
        opt_state=tx.init(params),
        loss_scale=loss_scale,
        clip_norm=1.0,
    )
    assert tree_equal(new_params, params)
    assert float(loss_scale.scale) == 2.0**14


def test_nnx_optimizer_passes_clip_norm_on():
    from flax import nnx

    def one_step(tx, clip_norm):
        model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        optimizer = lossscale.flax.Optimizer(
            model, tx, wrt=nnx.Param, loss_scale=64.0, clip_norm=clip_norm
        )
        grads = nnx.grad(
            lambda m: lossscale.scale_loss(jnp.sum(m(jnp.ones((4, 3))) ** 2), optimizer)
        )(model)
        optimizer.update(model, grads)
        return nnx.state(model, nnx.Param)

    ours = one_step(optax.sgd(0.5), 0.01)
    theirs = one_step(
        optax.chain(optax.clip_by_global_norm(0.01), optax.sgd(0.5)), None
    )
    unclipped = one_step(optax.sgd(0.5), None)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert not tree_equal(ours, unclipped)


@pytest.mark.parametrize(
    "clip_norm, error",
    [
        ("1", TypeError),
        (True, TypeError),
        (0.0, ValueError),
        (-1.0, ValueError),
        (np.inf, ValueError),
        (np.nan, ValueError),
    ],
)
def test_bad_clip_norms_are_refused(clip_norm, error):
    with pytest.raises(error, match="`clip_norm`"):
        lossscale.wrap(optax.sgd(0.1), clip_norm=clip_norm)
    tx = optax.sgd(0.1)
    params = {"w": jnp.ones(2)}
    with pytest.raises(error, match="`clip_norm`"):
        lossscale.apply_gradients(
            tx,
            grads=params,
            params=params,
            opt_state=tx.init(params),
            loss_scale=lossscale.NoOpLossScale(),
            clip_norm=clip_norm,
        )


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's figures")
def test_clip_norm_costs_no_pass_of_its_own_in_xla_bytes():
    # optax's clip in the chain reads the gradients for its norm and writes the
    # clipped ones; with clip_norm the norm is the check, and the step costs what
    # apply_gradients of plain Adam does.
    params = {f"p{i}": jnp.ones((20_000 + 1000 * i,), jnp.float32) for i in range(8)}
    grads = jax.tree.map(lambda p: p * 1e-3, params)
    extra_read = sum(g.nbytes for g in jax.tree.leaves(grads))
    plain_bytes, _ = compiled_costs(optax.adam(1e-3), params, grads)
    chain = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    chain_bytes, _ = compiled_costs(chain, params, grads)
    ours, temp = one_call_costs(params, grads, clip_norm=1.0)
    floor, floor_temp = cond_floor_costs(params, grads)  # the bare skip, this XLA
    bound = max(plain_bytes + extra_read * 1.05, floor + 0.05 * extra_read)
    assert ours <= bound, (ours / plain_bytes, floor / plain_bytes)
    assert ours < 0.8 * chain_bytes, ours / chain_bytes
    assert temp <= max(0.05 * extra_read, floor_temp + 4096), (temp, floor_temp)


def test_arguments_by_position_get_the_call_that_works():
    # Issue 42: Python's "takes 1 positional argument" named no fix.
    tx, params, good = _sgd_arguments()
    with pytest.raises(TypeError, match=r"grads=grads, params=params"):
        lossscale.apply_gradients(tx, good["grads"], params, good["opt_state"])
    wrapped = lossscale.wrap(tx)
    with pytest.raises(TypeError, match=r"value=loss"):
        wrapped.update(good["grads"], wrapped.init(params), params, jnp.float32(1.0))
    # The optimizer's step mistaken for `lossscale.update`: say which is which.
    with pytest.raises(TypeError, match=r"optimizer's step itself is `tx.update"):
        lossscale.update(good["grads"], good["opt_state"])


def test_train_state_apply_gradients_by_position_gets_the_keyword():
    flax_training = pytest.importorskip("lossscale.flax")
    _, params, good = _sgd_arguments()
    state = flax_training.TrainState.create(
        apply_fn=None, params=params, tx=optax.sgd(0.1)
    )
    with pytest.raises(TypeError, match=r"apply_gradients\(grads=grads\)"):
        state.apply_gradients(good["grads"])
    # By keyword it runs.
    assert state.apply_gradients(grads=good["grads"]).step == 1
