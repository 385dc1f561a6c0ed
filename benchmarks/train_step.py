"""Full train steps (forward, backward, update) in float16: lossscale and the peers.

    pip install -e ".[bench]"
    python benchmarks/train_step.py [--models mlp,transformer] [--steps 20]
    python benchmarks/train_step.py --models mlp-large,transformer-large  # on a GPU

Two models compute in float16 with float32 parameters: an MLP (4 layers of 1024,
batch 256) and a stack of 4 pre-norm transformer blocks (width 256, 4 heads, MLP
1024, 128 tokens, batch 16, vocabulary 512, next-token loss); `mlp-large` (4 layers
of 4096, batch 1024, 67M parameters) and `transformer-large` (8 blocks of width 1024,
16 heads, 512 tokens, vocabulary 8192, 109M parameters) for accelerators. Adam
everywhere. The baseline is the same float16 step without loss scaling; every
variant is timed interleaved with it in one process, jit-compiled with donated
buffers, and XLA's deterministic figures of each compiled step are reported beside
the times. A peer that fails to import, compile or run is reported as failed, with
the reason.
Results: a table on stdout, and `benchmarks/results/train_step.{json,md}`.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import traceback

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import peers  # noqa: E402
import report  # noqa: E402

import lossscale  # noqa: E402

LR = 1e-3
SCALE = 2.0**15
F16 = jnp.float16


# -- the models: float32 parameters, float16 compute, float32 loss ----------------


def mlp(key, width=1024, depth=4, batch=256, classes=10, compute=F16):
    keys = jax.random.split(key, depth + 2)
    sizes = [width] * depth + [classes]
    params = {
        f"layer{i}": {
            "w": jax.random.normal(k, (width, n), jnp.float32) / math.sqrt(width),
            "b": jnp.zeros((n,), jnp.float32),
        }
        for i, (k, n) in enumerate(zip(keys, sizes, strict=False))
    }
    x = jax.random.normal(keys[-2], (batch, width), jnp.float32)
    y = jax.random.randint(keys[-1], (batch,), 0, classes)

    def loss_fn(params, batch):
        h, labels = batch[0].astype(compute), batch[1]
        for i in range(depth + 1):
            layer = params[f"layer{i}"]
            h = h @ layer["w"].astype(compute) + layer["b"].astype(compute)
            if i < depth:
                h = jax.nn.gelu(h)
        logits = h.astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return params, (x, y), loss_fn


def transformer(
    key, width=256, heads=4, depth=4, tokens=128, rows=16, vocab=512, compute=F16
):
    keys = iter(jax.random.split(key, 6 * depth + 3))

    def dense(n_in, n_out):
        return jax.random.normal(next(keys), (n_in, n_out), jnp.float32) / math.sqrt(
            n_in
        )

    params = {"embed": dense(vocab, width) * math.sqrt(vocab) * 0.02}
    for i in range(depth):
        params[f"block{i}"] = {
            "ln1": jnp.ones((width,), jnp.float32),
            "qkv": dense(width, 3 * width),
            "out": dense(width, width),
            "ln2": jnp.ones((width,), jnp.float32),
            "up": dense(width, 4 * width),
            "down": dense(4 * width, width),
        }
    params["ln_f"] = jnp.ones((width,), jnp.float32)
    tokens_in = jax.random.randint(next(keys), (rows, tokens + 1), 0, vocab)
    mask = jnp.tril(jnp.ones((tokens, tokens), bool))

    def norm(h, gain):
        h32 = h.astype(jnp.float32)
        h32 = (h32 - h32.mean(-1, keepdims=True)) * jax.lax.rsqrt(
            h32.var(-1, keepdims=True) + 1e-5
        )
        return (h32 * gain).astype(compute)

    def loss_fn(params, batch):
        inputs, targets = batch[:, :-1], batch[:, 1:]
        h = params["embed"].astype(compute)[inputs]
        for i in range(depth):
            p = params[f"block{i}"]
            q, k, v = jnp.split(
                norm(h, p["ln1"]) @ p["qkv"].astype(compute), 3, axis=-1
            )
            split = lambda t: t.reshape(rows, tokens, heads, -1)  # noqa: E731
            logits = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k))
            logits = logits.astype(jnp.float32) / math.sqrt(width // heads)
            weights = jax.nn.softmax(jnp.where(mask, logits, -1e9), -1).astype(compute)
            attended = jnp.einsum("bhqk,bkhd->bqhd", weights, split(v))
            h = h + attended.reshape(rows, tokens, width) @ p["out"].astype(compute)
            up = jax.nn.gelu(norm(h, p["ln2"]) @ p["up"].astype(compute))
            h = h + up @ p["down"].astype(compute)
        logits = (norm(h, params["ln_f"]) @ params["embed"].astype(compute).T).astype(
            jnp.float32
        )
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return params, tokens_in, loss_fn


MODELS = {
    "mlp": mlp,
    "transformer": transformer,
    # Large enough that an accelerator's step time is the device's, not the host's
    # dispatch (at 4M parameters an H100 step takes ~0.2 ms, mostly dispatch).
    "mlp-large": functools.partial(mlp, width=4096, batch=1024),
    "transformer-large": functools.partial(
        transformer, width=1024, heads=16, depth=8, tokens=512, vocab=8192
    ),
}


# -- the variants: make(loss_fn) -> make(params) -> (step, state) -----------------


def unscaled_float16(loss_fn):
    def make(params):
        tx = optax.adam(LR)

        def step(params, opt_state, batch):
            grads = jax.grad(loss_fn)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        return step, tx.init(params)

    return make


def lossscale_wrap(loss_fn):
    def make(params):
        tx = lossscale.wrap(optax.adam(LR))

        def step(params, opt_state, batch):
            loss, grads = lossscale.value_and_grad(loss_fn)(opt_state, params, batch)
            updates, opt_state = tx.update(grads, opt_state, params, value=loss)
            return optax.apply_updates(params, updates), opt_state

        return step, tx.init(params)

    return make


def lossscale_apply_gradients(loss_fn):
    def make(params):
        tx = optax.adam(LR)

        def step(params, state, batch):
            opt_state, loss_scale = state
            loss, grads = lossscale.value_and_grad(loss_fn)(loss_scale, params, batch)
            params, opt_state, loss_scale = lossscale.apply_gradients(
                tx,
                grads=grads,
                params=params,
                opt_state=opt_state,
                loss_scale=loss_scale,
                value=loss,
            )
            return params, (opt_state, loss_scale)

        return step, (tx.init(params), lossscale.DynamicLossScale())

    return make


def lossscale_train_state(loss_fn):
    def make(params):
        import lossscale.flax

        state = lossscale.flax.TrainState.create(
            apply_fn=None, params=params, tx=optax.adam(LR)
        )

        def step(params, state, batch):
            state = state.replace(params=params)
            _, grads = lossscale.value_and_grad(loss_fn)(state, params, batch)
            state = state.apply_gradients(grads=grads)
            return state.params, state.replace(params=None)

        return step, state.replace(params=None)

    return make


def optax_apply_if_finite(loss_fn):
    def make(params):
        tx = optax.apply_if_finite(optax.adam(LR), max_consecutive_errors=10**6)

        def step(params, opt_state, batch):
            grads = jax.grad(lambda p: loss_fn(p, batch) * SCALE)(params)
            grads = jax.tree.map(lambda g: g / SCALE, grads)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        return step, tx.init(params)

    return make


def jmp_dynamic(loss_fn):
    def make(params):
        import jmp

        tx = optax.adam(LR)

        def step(params, state, batch):
            opt_state, loss_scale = state
            grads = jax.grad(lambda p: loss_scale.scale(loss_fn(p, batch)))(params)
            return peers.jmp_apply(tx, params, opt_state, loss_scale, grads)

        return step, (tx.init(params), jmp.DynamicLossScale(jnp.float32(SCALE)))

    return make


def flax_dynamic_scale(loss_fn):
    def make(params):
        from flax.training import train_state
        from flax.training.dynamic_scale import DynamicScale

        state = train_state.TrainState.create(
            apply_fn=None, params=params, tx=optax.adam(LR)
        )

        def step(params, carry, batch):
            state, dynamic_scale = carry
            state = state.replace(params=params)
            dynamic_scale, is_finite, _, grads = dynamic_scale.value_and_grad(loss_fn)(
                state.params, batch
            )
            new_state = peers.flax_apply_or_keep(state, is_finite, grads)
            return new_state.params, (new_state.replace(params=None), dynamic_scale)

        carry = (
            state.replace(params=None),
            DynamicScale(scale=jnp.float32(SCALE), fin_steps=jnp.int32(0)),
        )
        return step, carry

    return make


def keras_loss_scale_optimizer(loss_fn):
    def make(params):
        apply, variables = peers.keras_optimizer(
            params, learning_rate=LR, initial_scale=SCALE
        )

        def step(params, optimizer_variables, batch):
            # Keras scales by its current scale variable; a constant of the same
            # value does the same work here.
            grads = jax.grad(lambda p: loss_fn(p, batch) * SCALE)(params)
            return apply(params, optimizer_variables, grads)

        return step, variables

    return make


def mpx_dynamic(loss_fn):
    def make(params):
        import mpx

        tx = optax.adam(LR)

        def step(params, state, batch):
            opt_state, scaling = state
            _, scaling, finite, grads = mpx.filter_value_and_grad(loss_fn, scaling)(
                params, batch
            )
            params, opt_state = mpx.optimizer_update(
                params, tx, opt_state, grads, finite
            )
            return params, (opt_state, scaling)

        scaling = mpx.DynamicLossScaling(
            loss_scaling=jnp.float32(SCALE), min_loss_scaling=jnp.float32(1.0)
        )
        return step, (tx.init(params), scaling)

    return make


BASELINE = "float16, no loss scaling (baseline)"
VARIANTS = {
    BASELINE: unscaled_float16,
    "lossscale.wrap(adam), dynamic": lossscale_wrap,
    "lossscale.apply_gradients, dynamic": lossscale_apply_gradients,
    "lossscale.flax.TrainState, dynamic": lossscale_train_state,
    "optax.apply_if_finite(adam)": optax_apply_if_finite,
    "jmp DynamicLossScale + select_tree": jmp_dynamic,
    "Flax DynamicScale recipe": flax_dynamic_scale,
    "Keras 3 LossScaleOptimizer (stateless)": keras_loss_scale_optimizer,
    "mpx filter_value_and_grad + optimizer_update": mpx_dynamic,
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variants", default="", help="comma-separated substrings")
    parser.add_argument(
        "--out", default=os.path.join("benchmarks", "results", "train_step")
    )
    args = parser.parse_args(argv)

    rows = []
    for model in args.models.split(","):
        if model not in MODELS:
            parser.error(f"--models: unknown model {model!r}; known: {list(MODELS)}")
        params, batch, loss_fn = MODELS[model](jax.random.key(0))
        count = sum(p.size for p in jax.tree.leaves(params))
        variants = {
            name: make(loss_fn)
            for name, make in VARIANTS.items()
            if not args.variants
            or name == BASELINE
            or any(part in name for part in args.variants.split(","))
        }
        rows += report.compare(
            variants,
            params,
            batch,
            steps=args.steps,
            label=f"{model}, {count / 1e6:.1f}M params",
            baseline=BASELINE,
        )
        report.write(
            rows, args.out, title="Full train step, float16 compute", echo=False
        )
    report.write(rows, args.out, title="Full train step, float16 compute")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception:  # pragma: no cover - a report beats a stack trace
        traceback.print_exc()
        sys.exit(1)
