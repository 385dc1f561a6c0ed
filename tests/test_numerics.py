"""Numerics (`_src/step/finite.py`) on trees the size and shape of real models: many
small leaves, odd sizes, 1000 leaves.

The finiteness check and the clipping norm reduce small leaves in groups
(`forms.GROUP_BELOW`); these tests hold them to a numpy reference on trees
where grouping matters, and hold a 1000-leaf step to plain optax.
"""

import functools
import re

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import examples
from helpers import tree_equal
from hypothesis import given
from hypothesis import settings

import lossscale
from lossscale._src.step import forms

pytestmark = pytest.mark.usefixtures("strict_promotion")

SMALL_SHAPES = [(), (3,), (5, 7), (64, 16)]
DTYPES = [np.float32, np.float16, jnp.bfloat16]


def numpy_all_finite(tree):
    return all(
        np.isfinite(np.asarray(leaf, np.float32)).all()
        for leaf in jax.tree.leaves(tree)
    )


# -- zero-size leaves ----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_size_leaves_are_finite_and_pass_through(dtype):
    params = {"empty": jnp.zeros((0, 4), dtype), "w": jnp.ones(3, dtype)}
    grads = {"empty": jnp.zeros((0, 4), dtype), "w": jnp.full(3, 8.0, dtype)}
    assert bool(jax.jit(lossscale.all_finite)(grads))
    assert not bool(lossscale.all_finite({**grads, "w": jnp.full(3, np.inf, dtype)}))

    tx = optax.sgd(0.5)
    wrapped = lossscale.wrap(tx, lossscale.StaticLossScale(8.0))
    updates, _ = jax.jit(wrapped.update)(grads, wrapped.init(params), params)
    expected, _ = tx.update(
        {k: (v.astype(np.float32) / 8).astype(dtype) for k, v in grads.items()},
        tx.init(params),
    )
    assert tree_equal(updates, expected)

    new_params, _, _ = jax.jit(
        lambda g, p, s: lossscale.apply_gradients(
            tx,
            grads=g,
            params=p,
            opt_state=s,
            loss_scale=lossscale.StaticLossScale(8.0),
        )
    )(grads, params, tx.init(params))
    assert new_params["empty"].shape == (0, 4)
    assert tree_equal(new_params, optax.apply_updates(params, expected))


# -- grouped reductions ---------------------------------------------------------


@st.composite
def small_leaf_trees(draw):
    """Many leaves below the grouping size, of several shapes and dtypes; maybe one
    non-finite element in one of them, and maybe one leaf large enough to stand
    alone."""
    count = draw(st.integers(2, 40))
    leaves = []
    for i in range(count):
        shape = draw(st.sampled_from(SMALL_SHAPES))
        dtype = draw(st.sampled_from(DTYPES))
        leaves.append(np.full(shape, 0.5 + i, np.float32).astype(dtype))
    if draw(st.booleans()):
        leaves.append(np.ones((forms.GROUP_BELOW,), np.float16))
    if draw(st.booleans()):
        leaf = draw(st.integers(0, len(leaves) - 1))
        flat = leaves[leaf].reshape(-1).copy()
        flat[draw(st.integers(0, flat.size - 1))] = draw(
            st.sampled_from([np.nan, np.inf, -np.inf])
        )
        leaves[leaf] = flat.reshape(leaves[leaf].shape)
    return {f"p{i}": jnp.asarray(leaf) for i, leaf in enumerate(leaves)}


# Each example compiles a step: fewer than the suite's default.
@settings(max_examples=examples(15))
@given(small_leaf_trees())
def test_grouped_check_agrees_with_numpy(tree):
    # Jitted: one compile an example, where op by op each example compiles ~10.
    assert bool(jax.jit(lossscale.all_finite)(tree)) == numpy_all_finite(tree)


@settings(max_examples=examples(15))
@given(small_leaf_trees())
def test_grouped_clip_norm_agrees_with_optax(grads):
    grads = {k: v.astype(jnp.float32) for k, v in grads.items()}
    if not numpy_all_finite(grads):
        return  # the norm of a non-finite tree is not compared; it skips
    params = jax.tree.map(jnp.zeros_like, grads)
    wrapped = lossscale.wrap(optax.sgd(1.0), lossscale.NoOpLossScale(), clip_norm=1.0)
    updates, _ = jax.jit(wrapped.update)(grads, wrapped.init(params), params)
    reference = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    expected, _ = jax.jit(reference.update)(grads, reference.init(params), params)
    for got, want in zip(
        jax.tree.leaves(updates), jax.tree.leaves(expected), strict=True
    ):
        # The sum of squares is ordered by group, not by leaf.
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)


# The forms lowered for XLA:GPU (every leaf stacked by shape) and for the TPU (a
# reduction per leaf, scalars combined) run here on the CPU, against numpy.
FORMS = {"cpu": forms.grouped, "gpu": forms.partials, "tpu": forms.each}


def numpy_first_nonfinite(leaves):
    for position, leaf in enumerate(leaves):
        if not np.isfinite(np.asarray(leaf).astype(np.complex128)).all():
            return position
    return -1


@settings(max_examples=examples(20))
@given(small_leaf_trees(), st.sampled_from(sorted(FORMS)), st.booleans(), st.booleans())
def test_every_backend_form_finds_what_numpy_finds(tree, form, square, complex_leaf):
    leaves = jax.tree.leaves(tree)
    if complex_leaf:
        leaves.insert(1, jnp.asarray(np.array([1 + 2j, 3 - 1j], np.complex64)))
        if numpy_all_finite(tree):
            leaves[1] = leaves[1].at[1].set(complex(1, np.inf))
    positions = tuple(range(len(leaves)))
    total, first = jax.jit(
        lambda *arrays: FORMS[form](list(arrays), positions, square)
    )(*leaves)
    expected_first = numpy_first_nonfinite(leaves)
    assert int(first) == expected_first, (form, int(first), expected_first)
    assert bool(np.isfinite(total)) == (expected_first == -1)
    if square and expected_first == -1:
        wide = [np.asarray(leaf).astype(np.complex128) for leaf in leaves]
        expected = sum(float(np.sum(np.abs(x) ** 2)) for x in wide)
        # float32 sums of n squares: within n float32 roundings of the total.
        count = sum(x.size for x in wide)
        rtol = count * float(np.finfo(np.float32).eps)
        np.testing.assert_allclose(float(total), expected, rtol=rtol)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_backend_form_on_large_leaves_of_every_rank(form):
    # Large leaves go through each form's other paths (XLA:GPU's row probes of a
    # 1-D leaf cut into rows, of trailing axes, of a leaf with tiny rows).
    rng = np.random.default_rng(0)
    shapes = [(200_000,), (7919 * 2,), (64, 300), (3, 4, 500), (8192, 1), (5000,)]
    leaves = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    leaves.insert(3, np.ones((100,), np.float16))
    positions = tuple(range(len(leaves)))
    run = jax.jit(lambda *a, square: FORMS[form](list(a), positions, square),
                  static_argnames="square")  # fmt: skip
    expected = sum(float(np.sum(np.square(x, dtype=np.float64))) for x in leaves)
    total, first = run(*leaves, square=True)
    count = sum(x.size for x in leaves)
    np.testing.assert_allclose(
        float(total), expected, rtol=count * float(np.finfo(np.float32).eps)
    )
    assert int(first) == -1
    for bad, value in [(0, np.inf), (2, np.nan), (5, -np.inf), (6, np.nan)]:
        broken = [x.copy() for x in leaves]
        broken[bad].reshape(-1)[broken[bad].size // 2] = value
        for square in (False, True):
            total, first = run(*broken, square=square)
            assert (int(first), bool(np.isfinite(total))) == (bad, False), (
                form, square, bad, int(first))  # fmt: skip


@pytest.mark.parametrize("dtype", [np.complex64])
def test_clip_norm_of_complex_gradients_is_the_norm_of_their_moduli(dtype):
    # optax's `clip_by_global_norm` sums `|x|**2`; `x * x` would be NaN or wrong.
    grads = {"w": jnp.asarray(np.array([3 + 4j, 1j, -2], dtype))}
    params = jax.tree.map(jnp.zeros_like, grads)
    wrapped = lossscale.wrap(optax.sgd(1.0), lossscale.NoOpLossScale(), clip_norm=1.0)
    state = wrapped.init(params)
    updates, state = jax.jit(wrapped.update)(grads, state, params)
    reference = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    expected, _ = reference.update(grads, reference.init(params), params)
    assert int(lossscale.metrics(state)["skipped_steps"]) == 0
    # One float32 rounding of the norm, a few of the factor and the product.
    np.testing.assert_allclose(updates["w"], expected["w"], rtol=4e-7 * 4)


def test_a_finite_complex_gradient_whose_modulus_overflows_is_finite(backend_form):
    # |3e38 + 3e38j| is above float32's largest finite value; both parts are not.
    grads = {"w": jnp.asarray(np.array([3e38 + 3e38j, 1j], np.complex64))}
    assert bool(jax.jit(lossscale.all_finite)(grads))
    tx = optax.sgd(1e-3)
    params = jax.tree.map(jnp.zeros_like, grads)
    new, _, state = jax.jit(functools.partial(lossscale.apply_gradients, tx))(
        grads=grads,
        params=params,
        opt_state=tx.init(params),
        loss_scale=lossscale.NoOpLossScale(),
    )
    assert int(state.skipped_steps) == 0
    np.testing.assert_array_equal(new["w"], -1e-3 * np.asarray(grads["w"]))


def test_many_small_leaves_take_a_reduction_per_stack_not_per_leaf():
    # A stack of up to `forms.STACK` leaves of one shape is reduced once; the
    # stacks' probes are combined by one more reduction.
    def reductions(count):
        tree = [jnp.ones((64, 16), jnp.bfloat16) for _ in range(count)]
        text = jax.jit(lossscale.all_finite).lower(tree).as_text()
        return len(re.findall(r"stablehlo\.reduce\b", text))

    for count in (2, forms.STACK, forms.STACK + 1, 200):
        stacks = -(-count // forms.STACK)
        assert reductions(count) == stacks + 1, (count, reductions(count))


# -- a 1000-leaf step -------------------------------------------------------------


def thousand_leaf_tree():
    """1000 parameter leaves as a model has them: mostly small float32 leaves with
    float16 gradients, some 16-bit parameters, a large leaf and a zero-size one."""
    rng = np.random.default_rng(0)
    params, grad_dtypes = {}, {}
    for i in range(998):
        shape = SMALL_SHAPES[i % len(SMALL_SHAPES)]
        param_dtype = [np.float32, np.float32, np.float16, jnp.bfloat16][i % 4]
        grad_dtype = np.float16 if param_dtype == np.float32 else param_dtype
        params[f"p{i:03d}"] = rng.normal(size=shape).astype(param_dtype)
        grad_dtypes[f"p{i:03d}"] = grad_dtype
    params["big"] = rng.normal(size=(128, 64)).astype(np.float32)
    grad_dtypes["big"] = np.float16
    params["empty"] = np.zeros((0, 4), np.float16)
    grad_dtypes["empty"] = np.float16
    return params, grad_dtypes


def scaled_grads(params, grad_dtypes, scale, seed, bad_leaf=None):
    rng = np.random.default_rng(seed)
    grads = {
        name: (rng.normal(size=p.shape) * 1e-3 * scale).astype(grad_dtypes[name])
        for name, p in params.items()
    }
    if bad_leaf is not None:
        grads[bad_leaf].reshape(-1)[-1] = np.inf
    return grads


def unscaled(grads, params, scale):
    """The reference: each gradient divided by the scale in float32, then put in
    the wider of its own and its parameter's dtype."""
    wider = lambda a, b: a if a.itemsize > b.itemsize else b  # noqa: E731
    return {
        name: (g.astype(np.float32) / np.float32(scale)).astype(
            wider(params[name].dtype, g.dtype)
        )
        for name, g in grads.items()
    }


@pytest.mark.slow
def test_a_thousand_leaf_step_applies_skips_and_compiles_once():
    params, grad_dtypes = thousand_leaf_tree()
    params = jax.device_put(params)
    # A state that must be kept on a skip (the count), and updates that are
    # products only: with a sum in them (momentum, Adam's moments) XLA may
    # contract `g + 0.9 * m` into one multiply-add in one program and not in
    # the reference's, a difference of XLA's, not of this step's.
    inner = optax.chain(
        optax.sgd(0.1),
        optax.scale_by_schedule(lambda count: 1.0 / (1.0 + count.astype(jnp.float32))),
    )
    tx = lossscale.wrap(inner, "dynamic")

    wrap_update = jax.jit(tx.update)
    reference_update = jax.jit(inner.update)
    apply_updates = jax.jit(optax.apply_updates)

    state = (params, tx.init(params))
    # A bad element in a grouped small leaf, then in the large one.
    for seed, bad_leaf in enumerate([None, "p501", None, "big", None]):
        scale = float(lossscale.get_loss_scale(state[1]).scale)
        grads = scaled_grads(params, grad_dtypes, scale, seed, bad_leaf)
        updates, opt_state = wrap_update(grads, state[1], state[0])
        if bad_leaf is None:
            want = reference_update(
                unscaled(grads, params, scale), state[1].inner_state, state[0]
            )
            assert tree_equal((updates, opt_state.inner_state), want)
        else:
            assert tree_equal(opt_state.inner_state, state[1].inner_state)
            new_params = apply_updates(state[0], updates)
            assert tree_equal(new_params, state[0])
        state = (apply_updates(state[0], updates), opt_state)
    assert int(lossscale.metrics(state[1])["skipped_steps"]) == 2
    assert wrap_update._cache_size() == 1

    @jax.jit
    def apply_step(params, opt_state, loss_scale, grads):
        return lossscale.apply_gradients(
            inner,
            grads=grads,
            params=params,
            opt_state=opt_state,
            loss_scale=loss_scale,
        )

    # `apply_gradients` gives what `wrap` and `optax.apply_updates` give in one
    # program, bit for bit (the pages' exactness statement). Against the reference
    # of pre-divided gradients, a sum `params + updates` XLA:CPU may contract with
    # the unscaling multiply in one program and not in the other.
    @jax.jit
    def wrap_step(params, wrapped_state, grads):
        updates, wrapped_state = tx.update(grads, wrapped_state, params)
        return optax.apply_updates(params, updates), wrapped_state

    state = (params, inner.init(params), lossscale.DynamicLossScale())
    wrapped = (params, tx.init(params))
    for seed, bad_leaf in enumerate([None, "p502"]):
        scale = float(state[2].scale)
        grads = scaled_grads(params, grad_dtypes, scale, seed, bad_leaf)
        before = state
        state = apply_step(*state, grads)
        wrapped = wrap_step(*wrapped, grads)
        kept = slice(0, 2) if bad_leaf else slice(0, 0)
        assert tree_equal(state[kept], before[kept])
        assert tree_equal(state[0], wrapped[0])
        assert tree_equal(state[1:], (wrapped[1].inner_state, wrapped[1].loss_scale))
    assert int(state[2].skipped_steps) == 1
    assert apply_step._cache_size() == 1
