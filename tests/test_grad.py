"""`lossscale.value_and_grad`: gradients of the scaled loss, the loss unscaled."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import lossscale


def loss_fn(w, b, x, *, power=2):
    y = jnp.sum((w * x + b) ** power)
    return y, {"y": y, "w_norm": jnp.sum(w**2)}


W = jnp.array([0.5, -1.5, 2.0])
B = jnp.array(0.25)
X = jnp.array([1.0, 2.0, -3.0])


@pytest.mark.parametrize("argnums", [0, 1, (0,), (0, 1), (1, 0), [0, 2]])
def test_gradients_are_those_of_the_scaled_loss_and_the_loss_is_not(argnums):
    scale = 256.0
    grad_fn = jax.jit(lossscale.value_and_grad(loss_fn, has_aux=True, argnums=argnums))
    (loss, aux), grads = grad_fn(lossscale.StaticLossScale(scale), W, B, X, power=3)

    def reference(w, b, x):
        return scale * loss_fn(w, b, x, power=3)[0]

    jax_argnums = tuple(argnums) if isinstance(argnums, list) else argnums
    expected_grads = jax.grad(reference, argnums=jax_argnums)(W, B, X)
    expected_loss, expected_aux = loss_fn(W, B, X, power=3)
    assert type(grads) is type(expected_grads)
    for got, want in zip(
        jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
    np.testing.assert_allclose(aux["w_norm"], expected_aux["w_norm"], rtol=1e-6)


def test_without_aux_returns_loss_and_gradients():
    grad_fn = lossscale.value_and_grad(lambda w: jnp.sum(w**2))
    loss, grads = grad_fn(lossscale.StaticLossScale(8.0), W)
    np.testing.assert_allclose(loss, jnp.sum(W**2))
    np.testing.assert_allclose(grads, 8.0 * 2 * W)


def test_the_loss_keeps_its_dtype_while_the_scaled_loss_is_float32():
    # 57600 fits in float16; times a scale of 4 it would not. `scale_loss`
    # multiplies in float32, so only the gradient, 4 * 2 * 240, flows back.
    def f16_loss(w):
        return jnp.sum(w.astype(jnp.float16)) ** 2

    w = jnp.array([100.0, 100.0, 40.0])
    loss, grads = lossscale.value_and_grad(f16_loss)(lossscale.StaticLossScale(4), w)
    assert loss.dtype == jnp.float16 and float(loss) == 57600.0
    np.testing.assert_array_equal(grads, np.full(3, 1920.0, np.float32))


def test_accepts_an_optimizer_state_and_feeds_a_wrapped_optimizer():
    tx = lossscale.wrap(optax.sgd(0.5), lossscale.DynamicLossScale(scale=64.0))
    params = {"w": W}
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        loss, grads = lossscale.value_and_grad(lambda p: jnp.sum(p["w"] ** 2))(
            opt_state, params
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    new_params, _, loss = step(params, opt_state)
    np.testing.assert_allclose(new_params["w"], W - 0.5 * 2 * W, rtol=1e-6)
    np.testing.assert_allclose(loss, jnp.sum(W**2))


def test_compiles_once_across_scale_changes():
    grad_fn = jax.jit(lossscale.value_and_grad(lambda w: jnp.sum(w)))
    state = lossscale.DynamicLossScale()
    for finite in [True, False, False, True]:
        grad_fn(state, W)
        state = lossscale.update(state, jnp.array(finite))
    assert grad_fn._cache_size() == 1


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"argnums": "0"}, TypeError, "argnums"),
        ({"argnums": 1.0}, TypeError, "argnums"),
        ({"argnums": True}, TypeError, "argnums"),
        ({"argnums": (0, "1")}, TypeError, "argnums"),
        ({"argnums": ()}, ValueError, "empty"),
        ({"argnums": -1}, ValueError, ">= 0"),
        ({"has_aux": 1}, TypeError, "has_aux"),
        ({"axis_name": 3}, TypeError, "axis_name"),
    ],
)
def test_bad_settings_are_refused_eagerly(kwargs, error, match):
    with pytest.raises(error, match=match):
        lossscale.value_and_grad(loss_fn, **kwargs)


def test_bad_calls_name_the_problem():
    with pytest.raises(TypeError, match="callable"):
        lossscale.value_and_grad(3)
    one = lossscale.NoOpLossScale()
    with pytest.raises(ValueError, match="1 positional"):
        lossscale.value_and_grad(loss_fn, argnums=1)(one, W)
    with pytest.raises(ValueError, match="scalar"):
        lossscale.value_and_grad(lambda w: w)(one, W)
    with pytest.raises(TypeError, match="loss-scale state"):
        lossscale.value_and_grad(lambda w: jnp.sum(w))(object(), W)


def test_axis_name_averages_the_gradients_and_every_replica_decides_alike():
    n = 2
    w = jnp.array([1.0, -2.0])
    x = jnp.array([[1.0, 2.0], [3.0, 5.0]])  # one row per device
    loss_scale = lossscale.StaticLossScale(4.0)
    grad_fn = lossscale.value_and_grad(lambda w, x: jnp.sum(w * x), axis_name="i")
    losses, grads = jax.pmap(grad_fn, axis_name="i", in_axes=(None, None, 0))(
        loss_scale, w, x
    )
    expected = 4.0 * np.mean(np.asarray(x), axis=0)  # the scaled mean gradient
    for device in range(n):
        np.testing.assert_allclose(grads[device], expected, rtol=1e-6)
        assert float(losses[device]) == float(jnp.sum(w * x[device]))  # its own
    # One device's overflow reaches every replica: all skip together.
    tx = lossscale.wrap(optax.sgd(0.1), loss_scale)
    opt_state = tx.init(w)

    def step(w, x):
        _, grads = grad_fn(opt_state, w, x)
        updates, state = tx.update(grads, opt_state, w)
        return optax.apply_updates(w, updates), state.loss_scale.skipped_steps

    x_bad = x.at[1, 0].set(jnp.inf)
    new_w, skipped = jax.pmap(step, axis_name="i", in_axes=(None, 0))(w, x_bad)
    np.testing.assert_array_equal(skipped, [1, 1])
    np.testing.assert_array_equal(new_w, np.stack([w, w]))
    # Without `axis_name` the replicas would disagree: the first one applies.
    plain = lossscale.value_and_grad(lambda w, x: jnp.sum(w * x))

    def local_step(w, x):
        _, grads = plain(opt_state, w, x)
        return tx.update(grads, opt_state, w)[1].loss_scale.skipped_steps

    np.testing.assert_array_equal(
        jax.pmap(local_step, axis_name="i", in_axes=(None, 0))(w, x_bad), [0, 1]
    )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_has_aux_true_with_a_loss_alone_says_to_drop_has_aux(jit):
    grad_fn = lossscale.value_and_grad(lambda w: jnp.sum(w), has_aux=True)
    grad_fn = jax.jit(grad_fn) if jit else grad_fn
    with pytest.raises(TypeError, match=r"pair `\(loss, aux\)`") as info:
        grad_fn(lossscale.NoOpLossScale(), W)
    assert "returned a float32 scalar" in str(info.value)
    assert "pass `has_aux=False`" in str(info.value)


def test_has_aux_false_with_a_pair_says_to_pass_has_aux():
    grad_fn = lossscale.value_and_grad(loss_fn)  # returns (loss, aux)
    with pytest.raises(TypeError, match=r"returned a tuple of 2") as info:
        grad_fn(lossscale.NoOpLossScale(), W, B, X)
    assert "pass `has_aux=True`" in str(info.value)


@pytest.mark.parametrize("axis_name", ["i", ("i", "j")])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_axis_name_outside_a_mapped_function_says_what_to_do(axis_name, jit):
    grad_fn = lossscale.value_and_grad(lambda w: jnp.sum(w), axis_name=axis_name)
    grad_fn = jax.jit(grad_fn) if jit else grad_fn
    with pytest.raises(ValueError, match="binds the axis 'i'") as info:
        grad_fn(lossscale.NoOpLossScale(), W)
    assert "jax.pmap(train_step, axis_name='i')" in str(info.value)
    assert "drop `axis_name`" in str(info.value)


def test_an_axis_bound_by_vmap_but_not_its_partner_is_named():
    grad_fn = lossscale.value_and_grad(lambda w: jnp.sum(w), axis_name=("i", "j"))
    with pytest.raises(ValueError, match="binds the axis 'j'"):
        jax.vmap(grad_fn, in_axes=(None, 0), axis_name="i")(
            lossscale.NoOpLossScale(), jnp.stack([W, W])
        )


def test_axis_name_works_under_vmap_and_shard_map(mesh):
    # The check must not refuse an axis that is bound: the mean over the axis, as
    # numpy computes it, on every replica.
    x = np.arange(16.0, dtype=np.float32).reshape(8, 2)
    w = jnp.array([1.0, -2.0])
    scale = 4.0
    expected = scale * x.mean(axis=0)
    grad_fn = lossscale.value_and_grad(lambda w, x: jnp.sum(w * x), axis_name="data")
    loss_scale = lossscale.StaticLossScale(scale)
    _, vmapped = jax.vmap(grad_fn, in_axes=(None, None, 0), axis_name="data")(
        loss_scale, w, jnp.asarray(x)
    )

    def local(w, x):
        # A replica of `w` per device, as `pmap` has: a `w` closed over would be
        # invariant over the mesh, and its gradient summed by JAX itself.
        return grad_fn(loss_scale, w[0], x[0])[1][None]

    sharded = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    )(jnp.stack([w] * 8), jnp.asarray(x))
    for got in (vmapped, sharded):
        for row in np.asarray(got):
            np.testing.assert_allclose(row, expected, rtol=1e-6)


@pytest.mark.parametrize("first", ["params", "missing"])
def test_the_loss_scale_left_out_or_misplaced_says_what_comes_first(first):
    grad_fn = lossscale.value_and_grad(lambda w, x: jnp.sum(w * x))
    tx = lossscale.wrap(optax.sgd(0.1))
    with pytest.raises((TypeError, ValueError)) as info:
        if first == "params":  # params where the loss scale goes, state last
            grad_fn({"w": W}, X, tx.init({"w": W}))
        else:
            grad_fn(W, X)
    assert "`grad_fn(loss_scale, *args, **kwargs)`" in str(info.value)
