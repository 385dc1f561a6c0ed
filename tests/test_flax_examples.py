"""Flax's ImageNet and WMT train steps, ported to lossscale, side by side with upstream.

Each `upstream_*_step` is the example's `train_step` as Flax writes it (with
`DynamicScale` and the select over params and optimizer state), on a small model;
each `ported_*_step` is what `docs/migration/flax_dynamic_scale.md` tells a user to
write. Both run on 2 host devices, under `pmap` (as the examples do) and under `jit`
with the batch sharded, with the settings that reproduce `DynamicScale`.
"""

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import jax_utils
from flax.training import common_utils
from flax.training import dynamic_scale as dynamic_scale_lib
from flax.training import train_state
from helpers import assert_one_step_close
from helpers import bitwise_equal
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lossscale
import lossscale.flax

pytestmark = pytest.mark.slow  # each test compiles two pmapped or sharded models

DEVICES = 2
GROWTH_INTERVAL = 2  # DynamicScale's; small, so that the runs grow as well as back off
START = 2.0**20  # overflows float16's backward pass: the runs start by backing off


def like_dynamic_scale():
    """The migration page's settings that reproduce `DynamicScale`'s scales."""
    return lossscale.DynamicLossScale(
        scale=START,
        growth_interval=GROWTH_INTERVAL + 1,
        min_scale=float(np.finfo(np.float32).tiny),
        max_scale=float(np.finfo(np.float32).max),
    )


def upstream_dynamic_scale():
    return dynamic_scale_lib.DynamicScale(
        growth_interval=GROWTH_INTERVAL, scale=jnp.float32(START)
    )


# -- ImageNet: ResNet with BatchNorm, SGD with Nesterov momentum, weight decay ------


class TinyResNet(nn.Module):
    """`examples/imagenet/models.py`'s ResNet, one block of 4 filters."""

    axis_name: str | None
    dtype: Any = jnp.float16

    @nn.compact
    def __call__(self, x, train=True):
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
            axis_name=self.axis_name,
        )
        x = nn.relu(norm()(conv(4, (3, 3))(x)))
        y = nn.relu(norm()(conv(4, (3, 3))(x)))
        y = norm(scale_init=nn.initializers.zeros_init())(conv(4, (3, 3))(y))
        x = nn.relu(x + y)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(10, dtype=self.dtype)(x)
        return jnp.asarray(x, self.dtype)


LEARNING_RATE = optax.warmup_cosine_decay_schedule(0.02, 0.1, 2, 20)


def imagenet_loss(apply_fn, batch_stats, batch):
    def loss_fn(params):
        logits, new_model_state = apply_fn(
            {"params": params, "batch_stats": batch_stats},
            batch["image"],
            mutable=["batch_stats"],
        )
        one_hot = common_utils.onehot(batch["label"], num_classes=10)
        loss = jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot))
        weight_l2 = sum(
            jnp.sum(x**2) for x in jax.tree_util.tree_leaves(params) if x.ndim > 1
        )
        return loss + 0.0001 * 0.5 * weight_l2, (new_model_state, logits)

    return loss_fn


class UpstreamImageNetState(train_state.TrainState):
    batch_stats: Any
    dynamic_scale: dynamic_scale_lib.DynamicScale


def upstream_imagenet_step(state, batch, axis_name, keep_batch_stats=False):
    loss_fn = imagenet_loss(state.apply_fn, state.batch_stats, batch)
    grad_fn = state.dynamic_scale.value_and_grad(
        loss_fn, has_aux=True, axis_name=axis_name
    )
    dynamic_scale, is_fin, aux, grads = grad_fn(state.params)
    new_model_state, _ = aux[1]
    new_state = state.apply_gradients(
        grads=grads, batch_stats=new_model_state["batch_stats"]
    )
    select = functools.partial(jnp.where, is_fin)
    if keep_batch_stats:  # what lossscale does: a skipped step keeps every field
        new_state = new_state.replace(
            batch_stats=jax.tree_util.tree_map(
                select, new_state.batch_stats, state.batch_stats
            )
        )
    return new_state.replace(
        opt_state=jax.tree_util.tree_map(select, new_state.opt_state, state.opt_state),
        params=jax.tree_util.tree_map(select, new_state.params, state.params),
        dynamic_scale=dynamic_scale,
    )


class PortedImageNetState(lossscale.flax.TrainState):
    batch_stats: Any


def ported_imagenet_step(state, batch, axis_name):
    loss_fn = imagenet_loss(state.apply_fn, state.batch_stats, batch)
    grad_fn = lossscale.value_and_grad(loss_fn, has_aux=True, axis_name=axis_name)
    (loss, (new_model_state, _)), grads = grad_fn(state, state.params)
    return state.apply_gradients(
        grads=grads, value=loss, batch_stats=new_model_state["batch_stats"]
    )


def imagenet_states(axis_name):
    model = TinyResNet(axis_name=axis_name)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 8, 8, 3)))
    tx = optax.sgd(LEARNING_RATE, momentum=0.9, nesterov=True)
    common = dict(
        apply_fn=model.apply,
        params=variables["params"],
        tx=tx,
        batch_stats=variables["batch_stats"],
    )
    upstream = UpstreamImageNetState.create(
        **common, dynamic_scale=upstream_dynamic_scale()
    )
    ported = PortedImageNetState.create(
        **common, loss_scale=like_dynamic_scale(), axis_name=axis_name
    )
    return upstream, ported


def imagenet_batch(seed, overflow=False):
    rng = np.random.default_rng(seed)
    image = rng.normal(size=(DEVICES * 4, 8, 8, 3)).astype(np.float32)
    if overflow:
        image[0] = 1e6  # the forward pass overflows float16
    return {"image": image, "label": rng.integers(0, 10, size=DEVICES * 4)}


# -- WMT: Transformer with dropout, AdamW, label smoothing, padding weights ---------


class TinyTransformer(nn.Module):
    """An encoder layer of `examples/wmt/models.py`, 2 heads of 4 features."""

    dtype: Any = jnp.float16

    @nn.compact
    def __call__(self, tokens, dropout_rng):
        x = nn.Embed(16, 8, dtype=self.dtype)(tokens)
        y = nn.LayerNorm(dtype=self.dtype)(x)
        y = nn.MultiHeadDotProductAttention(
            num_heads=2, dtype=self.dtype, dropout_rate=0.1, deterministic=False
        )(y, mask=nn.make_attention_mask(tokens > 0, tokens > 0))
        x = x + nn.Dropout(0.1, deterministic=False)(y)
        y = nn.Dense(16, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))
        x = x + nn.Dense(8, dtype=self.dtype)(nn.relu(y))
        return nn.Dense(16, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))


def weighted_cross_entropy(logits, targets, weights, label_smoothing=0.1):
    """`examples/wmt/train.py`'s `compute_weighted_cross_entropy`."""
    vocab_size = logits.shape[-1]
    confidence = 1.0 - label_smoothing
    low_confidence = (1.0 - confidence) / (vocab_size - 1)
    normalizing_constant = -(
        confidence * jnp.log(confidence)
        + (vocab_size - 1) * low_confidence * jnp.log(low_confidence + 1e-20)
    )
    soft_targets = common_utils.onehot(
        targets, vocab_size, on_value=confidence, off_value=low_confidence
    )
    loss = -jnp.sum(soft_targets * nn.log_softmax(logits), axis=-1)
    loss = (loss - normalizing_constant) * weights
    return loss.sum(), weights.sum()


def wmt_loss(apply_fn, batch, dropout_rng):
    weights = jnp.where(batch["targets"] > 0, 1, 0).astype(jnp.float32)

    def loss_fn(params):
        logits = apply_fn(
            {"params": params},
            batch["inputs"],
            dropout_rng,
            rngs={"dropout": dropout_rng},
        )
        loss, weight_sum = weighted_cross_entropy(logits, batch["targets"], weights)
        return loss / weight_sum, logits

    return loss_fn


def upstream_wmt_step(state, batch, dropout_rng, axis_name):
    loss_fn = wmt_loss(state.apply_fn, batch, dropout_rng)
    grad_fn = state.dynamic_scale.value_and_grad(
        loss_fn, has_aux=True, axis_name=axis_name
    )
    dynamic_scale, is_fin, (_, logits), grads = grad_fn(state.params)
    state = state.replace(dynamic_scale=dynamic_scale)
    new_state = state.apply_gradients(grads=grads)
    select = functools.partial(jnp.where, is_fin)
    return new_state.replace(
        opt_state=jax.tree_util.tree_map(select, new_state.opt_state, state.opt_state),
        params=jax.tree_util.tree_map(select, new_state.params, state.params),
    )


class UpstreamWMTState(train_state.TrainState):
    dynamic_scale: dynamic_scale_lib.DynamicScale


def ported_wmt_step(state, batch, dropout_rng, axis_name):
    loss_fn = wmt_loss(state.apply_fn, batch, dropout_rng)
    grad_fn = lossscale.value_and_grad(loss_fn, has_aux=True, axis_name=axis_name)
    (loss, _), grads = grad_fn(state, state.params)
    return state.apply_gradients(grads=grads, value=loss)


def wmt_states(axis_name):
    model = TinyTransformer()
    tokens = jnp.ones((1, 6), jnp.int32)
    key = jax.random.key(0)
    params = jax.jit(model.init)({"params": key, "dropout": key}, tokens, key)["params"]
    tx = optax.adamw(LEARNING_RATE, b1=0.9, b2=0.98, eps=1e-9, weight_decay=1e-3)
    upstream = UpstreamWMTState.create(
        apply_fn=model.apply,
        params=params,
        tx=tx,
        dynamic_scale=upstream_dynamic_scale(),
    )
    ported = lossscale.flax.TrainState.create(
        apply_fn=model.apply,
        params=params,
        tx=tx,
        loss_scale=like_dynamic_scale(),
        axis_name=axis_name,
    )
    return upstream, ported


def wmt_batch(seed):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(1, 16, size=(DEVICES * 4, 6))
    inputs[:, 4:] = 0  # padding, weighted out of the loss
    targets = np.roll(inputs, -1, axis=1)
    return {"inputs": inputs.astype(np.int32), "targets": targets.astype(np.int32)}


# -- Running both: pmap as the examples do, and jit with the batch sharded ----------


def per_device(tree):
    return jax.tree.map(lambda x: x.reshape(DEVICES, -1, *x.shape[1:]), tree)


def runners(step, mode):
    """`(run, place, get)`: a step under `pmap`, or `jit` with the batch sharded."""
    devices = jax.devices()[:DEVICES]
    mesh = Mesh(np.array(devices), ("batch",))
    if mode == "pmap":
        mapped = jax.pmap(
            functools.partial(step, axis_name="batch"),
            axis_name="batch",
            devices=devices,
        )

        def run(state, batch, *rest):
            rest = [jax_utils.replicate(r, devices) for r in rest]
            return mapped(state, per_device(batch), *rest)

        def place(state):  # on pmap's own mesh: it compiles once (last test)
            stacked = jax.tree.map(lambda x: np.stack([x] * DEVICES), state)
            return jax.device_put(stacked, NamedSharding(mesh, P("batch")))

        return run, place, jax_utils.unreplicate
    jitted = jax.jit(functools.partial(step, axis_name=None))

    def run(state, batch, *rest):
        batch = jax.device_put(batch, NamedSharding(mesh, P("batch")))
        return jitted(state, batch, *rest)

    return (
        run,
        lambda state: jax.device_put(state, NamedSharding(mesh, P())),
        lambda s: s,
    )


def side_by_side(states, upstream_step, ported_step, mode):
    """Both states placed, both steps' runners, and `get` (to the host's view)."""
    upstream, ported = states("batch" if mode == "pmap" else None)
    run_up, put, get = runners(upstream_step, mode)
    run_ours, _, _ = runners(ported_step, mode)
    return put(upstream), put(ported), run_up, run_ours, get


def assert_same_step(before, upstream, ported, fields):
    """Each leaf of `fields` as upstream's step left it, starting from `before`.

    Both steps start from the same state (the test copies upstream's into ours
    before each step), so differences cannot compound over steps: the tolerance
    is one step's, `helpers.assert_one_step_close`'s (float16's epsilon of the
    leaf's largest change this step, plus a few float32 ulps). Not bit for bit:
    XLA fuses the two programs differently, and on another CPU differently again.
    """
    for name in fields:
        assert_one_step_close(
            getattr(before, name), getattr(upstream, name), getattr(ported, name), name
        )


def same_start(ported, upstream, fields):
    """`ported` with upstream's `fields`: both steps then start from one state."""
    return ported.replace(**{name: getattr(upstream, name) for name in fields})


@pytest.mark.parametrize("mode", ["pmap", "jit"])
def test_the_imagenet_step_ported_trains_as_upstream(mode):
    # Upstream writes `batch_stats` on skipped steps, lossscale keeps them (the
    # next test): the comparison adds that select to upstream's step. The
    # parameters do not depend on it (training normalizes by batch statistics).
    keep = functools.partial(upstream_imagenet_step, keep_batch_stats=True)
    upstream, ported, run_up, run_ours, get = side_by_side(
        imagenet_states, keep, ported_imagenet_step, mode
    )
    fields = ["params", "opt_state", "batch_stats"]
    trace_up = []
    for i in range(12):
        batch = imagenet_batch(i)
        ported = same_start(ported, upstream, fields)
        before = get(upstream)
        upstream, ported = run_up(upstream, batch), run_ours(ported, batch)
        up, ours = get(upstream), get(ported)
        skipped = bitwise_equal(up.params, before.params)
        trace_up.append((up.dynamic_scale.scale, skipped))
        assert float(ours.loss_scale.scale) == float(up.dynamic_scale.scale), i
        assert bitwise_equal(ours.params, before.params) == skipped, i
        assert_same_step(before, up, ours, fields)
    scales = [float(scale) for scale, _ in trace_up]
    skipped = [skip for _, skip in trace_up]
    # Both sides backed off (skipping) and then grew: the runs test both paths.
    assert any(skipped) and not all(skipped)
    assert min(scales) < START
    assert any(b > a for a, b in zip(scales, scales[1:], strict=False))
    assert int(ours.loss_scale.skipped_steps) == sum(skipped)
    assert int(ours.step) == 12 - sum(skipped)


@pytest.mark.parametrize("mode", ["pmap", "jit"])
def test_a_forward_overflow_batch_keeps_batch_norm_statistics_finite(mode):
    upstream, ported, run_up, run_ours, get = side_by_side(
        imagenet_states, upstream_imagenet_step, ported_imagenet_step, mode
    )
    before = get(ported)
    upstream = run_up(upstream, imagenet_batch(0, overflow=True))
    ported = run_ours(ported, imagenet_batch(0, overflow=True))
    ours = get(ported)
    assert bitwise_equal(ours.batch_stats, before.batch_stats)
    assert bitwise_equal(ours.params, before.params)
    assert int(ours.loss_scale.forward_overflows) == 1
    assert float(ours.loss_scale.scale) == START  # a forward overflow: no back-off
    # Upstream's step writes the statistics of the overflowing batch (why the
    # migration page points this out); its parameters are kept.
    up = get(upstream)
    assert not all(np.isfinite(x).all() for x in jax.tree.leaves(up.batch_stats))
    assert bitwise_equal(up.params, before.params)
    ported = run_ours(ported, imagenet_batch(1))  # and it trains on, finite
    for leaf in jax.tree.leaves(get(ported).batch_stats):
        assert np.isfinite(np.asarray(leaf)).all()


@pytest.mark.parametrize("mode", ["pmap", "jit"])
def test_the_wmt_step_ported_trains_as_upstream(mode):
    upstream, ported, run_up, run_ours, get = side_by_side(
        wmt_states, upstream_wmt_step, ported_wmt_step, mode
    )
    fields = ["params", "opt_state"]
    skipped = []
    for i in range(12):
        # The examples fold `state.step` into the dropout key; Flax's step counts
        # skipped steps and ours does not, so both sides fold in the loop's count.
        dropout_rng = jax.random.fold_in(jax.random.key(1), i)
        ported = same_start(ported, upstream, fields)
        before = get(upstream)
        upstream = run_up(upstream, wmt_batch(i), dropout_rng)
        ported = run_ours(ported, wmt_batch(i), dropout_rng)
        up, ours = get(upstream), get(ported)
        skipped.append(bitwise_equal(up.params, before.params))
        assert float(ours.loss_scale.scale) == float(up.dynamic_scale.scale), i
        assert bitwise_equal(ours.params, before.params) == skipped[-1], i
        assert_same_step(before, up, ours, fields)
    assert any(skipped) and not all(skipped)
    assert int(ours.loss_scale.skipped_steps) == sum(skipped)
    assert int(ours.step) == 12 - sum(skipped)


class CountCompiles:
    """Counts the programs compiled (any function) while in the `with` block.

    A program is compiled by XLA or, when the same program was compiled before in
    this process, read back from the tests' compilation cache (conftest.py): either
    way the call missed jit's cache, which is what the count is about.
    """

    EVENTS = (
        "/jax/core/compile/backend_compile_duration",
        "/jax/compilation_cache/cache_retrieval_time_sec",  # only on a cache hit
    )

    def __enter__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def _listen(self, event, duration, **kwargs):
        self.count += event in self.EVENTS

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen)


def test_under_pmap_a_replicated_state_compiles_twice_and_one_on_the_axis_mesh_once():
    """The call pattern behind the "compiles once" claim (docs/guides/flax.md)."""
    devices = jax.devices()[:DEVICES]
    upstream, ported = imagenet_states("batch")
    for state, step in [
        (upstream, upstream_imagenet_step),
        (ported, ported_imagenet_step),
    ]:
        run, place, _ = runners(step, "pmap")
        compiles = []  # per call
        # `flax.jax_utils.replicate` puts the state on a mesh named
        # "_device_put_sharded"; pmap returns it on one named "batch": the second
        # call sees another sharding and compiles again, for Flax's state as well.
        replicated = jax_utils.replicate(state, devices)
        for i in range(3):
            with CountCompiles() as counted:
                replicated = run(replicated, imagenet_batch(i))
            compiles.append(counted.count)
        assert compiles[0] >= 1 and compiles[1] >= 1 and compiles[2] == 0
        # Placed on a mesh whose axis is pmap's, it compiles once (here not at
        # all: the program is cached from the run above).
        placed = place(state)
        with CountCompiles() as counted:
            for i in range(3):
                placed = run(placed, imagenet_batch(i))
        assert counted.count == 0
