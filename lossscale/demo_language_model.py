"""A byte-level transformer language model on real English text, in float16.

    python -m lossscale.demo_language_model   # the full run (about 10 min, 2 CPUs)
    python -m lossscale.demo_language_model --steps 40 --seeds 0 --quick  # smoke run

A small decoder-only transformer (Flax linen; float32 master parameters, float16
matmuls; layer norms and softmax in float32 unless `--float16-norms`) learns to
predict the next byte of the Python documentation that ships with every Python
(`pydoc_data.topics`, about 466 kB; the last 10% held out). Three runs with the same
seed and batches: float32, float16 without loss scaling, float16 with
`lossscale.apply_gradients` and a dynamic scale. Reported per run and seed: held-out
loss (nats per byte), skipped steps and the final scale; the loss curves as a PNG;
and gradient fidelity at the float32 run's parameters on a fixed batch: the relative
error of the float16 gradient against the float32 one, and the share of elements
that are non-zero in float32 but zero in float16, with and without the scale.
Results: `benchmarks/results/language_model.{json,md,png}` (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import lossscale

F32, F16, BF16 = jnp.float32, jnp.float16, jnp.bfloat16


def corpus() -> tuple[np.ndarray, np.ndarray]:
    """The documentation's bytes, in topic order; 90% to train on, 10% held out."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    data = np.frombuffer(
        "".join(topics[key] for key in sorted(topics)).encode("utf-8"), np.uint8
    )
    split = int(0.9 * len(data))
    return data[:split], data[split:]


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and an MLP, in `compute`."""

    width: int
    heads: int
    compute: jnp.dtype
    norms: jnp.dtype

    @nn.compact
    def __call__(self, x):
        """The block on `x`, tokens by width."""
        dense = dict(dtype=self.compute, param_dtype=F32)
        tokens = x.shape[1]
        h = nn.LayerNorm(dtype=self.norms, param_dtype=F32)(x).astype(self.compute)
        q, k, v = jnp.split(nn.Dense(3 * self.width, **dense)(h), 3, axis=-1)
        shape = (*h.shape[:2], self.heads, self.width // self.heads)
        q, k, v = (t.reshape(shape) for t in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(shape[-1])
        causal = jnp.tril(jnp.ones((tokens, tokens), bool))
        scores = jnp.where(causal, scores.astype(self.norms), -1e4)
        weights = jax.nn.softmax(scores, axis=-1).astype(self.compute)
        attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(h.shape)
        x = x + nn.Dense(self.width, **dense)(attended)
        h = nn.LayerNorm(dtype=self.norms, param_dtype=F32)(x).astype(self.compute)
        h = nn.Dense(self.width, **dense)(nn.gelu(nn.Dense(4 * self.width, **dense)(h)))
        return x + h


class ByteLM(nn.Module):
    """A byte-level decoder-only transformer: 256 byte logits per position."""

    width: int = 64
    layers: int = 2
    heads: int = 4
    context: int = 128
    compute: jnp.dtype = F32
    norms: jnp.dtype = F32

    @nn.compact
    def __call__(self, tokens):
        """Next-byte logits for a batch of byte `tokens`."""
        embed = nn.Embed(256, self.width, param_dtype=F32)
        position = self.param(
            "position", nn.initializers.normal(0.02), (self.context, self.width), F32
        )
        x = (embed(tokens) + position[: tokens.shape[1]]).astype(self.compute)
        for _ in range(self.layers):
            x = Block(self.width, self.heads, self.compute, self.norms)(x)
        x = nn.LayerNorm(dtype=self.norms, param_dtype=F32)(x).astype(self.compute)
        return embed.attend(x.astype(F32) if self.compute == F32 else x)


def batches(data, batch, context, seed):
    """An endless stream of (inputs, targets) windows, the same for every run."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - context - 1, batch)
        windows = np.stack([data[s : s + context + 1] for s in starts])
        yield jnp.asarray(windows[:, :-1], jnp.int32), jnp.asarray(windows[:, 1:])


def cross_entropy(logits, targets):
    """The mean next-byte cross-entropy in float32, nats per byte."""
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(F32), targets
    ).mean()


RUNS = {
    "float32": (F32, None),
    "bfloat16": (BF16, lossscale.NoOpLossScale()),
    "float16, no loss scaling": (F16, lossscale.NoOpLossScale()),
    "float16, dynamic loss scaling": (F16, lossscale.DynamicLossScale()),
}


def model_for(args, compute):
    """The model of the command line's size, computing in `compute`."""
    norms = F16 if (args.float16_norms and compute == F16) else F32
    return ByteLM(
        width=args.width,
        layers=args.layers,
        heads=args.heads,
        compute=compute,
        norms=norms,
        context=args.context,
    )


def train(name, args, data, held_out, seed):
    """One run (`RUNS[name]`) for `args.steps` steps: its losses, scale, skips."""
    compute, loss_scale = RUNS[name]
    model = model_for(args, compute)
    stream = batches(data, args.batch, args.context, seed)
    params = model.init(jax.random.key(seed), next(stream)[0])["params"]
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.learning_rate, max(args.steps // 10, 1), args.steps, 1e-4
    )
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))
    opt_state = tx.init(params)
    loss_scale = loss_scale if loss_scale is not None else lossscale.NoOpLossScale()

    @jax.jit
    def step(params, opt_state, loss_scale, x, y):
        loss_fn = lambda p: cross_entropy(model.apply({"params": p}, x), y)  # noqa: E731
        loss, grads = lossscale.value_and_grad(loss_fn)(loss_scale, params)
        params, opt_state, loss_scale = lossscale.apply_gradients(
            tx, grads=grads, params=params, opt_state=opt_state, loss_scale=loss_scale
        )
        return params, opt_state, loss_scale, loss

    evaluate = jax.jit(lambda p, x, y: cross_entropy(model.apply({"params": p}, x), y))
    held_stream = batches(held_out, 64, args.context, 1)
    held = [next(held_stream) for _ in range(args.eval_batches)]
    losses, scales = [], []
    for index in range(args.steps):
        if index == 1:  # the first step compiled; time the others
            jax.block_until_ready(params)
            start = time.perf_counter()
        x, y = next(stream)
        params, opt_state, loss_scale, loss = step(params, opt_state, loss_scale, x, y)
        losses.append(loss)
        scales.append(loss_scale.scale)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start if args.steps > 1 else float("nan")
    held_loss = float(np.mean([evaluate(params, x, y) for x, y in held]))
    metrics = {k: v.item() for k, v in lossscale.metrics(loss_scale).items()}
    return {
        "losses": np.asarray(jnp.stack(losses)).tolist(),
        "scales": np.asarray(jnp.stack(scales)).tolist(),
        "held_out_loss": held_loss,
        "skipped_steps": metrics["skipped_steps"],
        "final_scale": metrics["loss_scale"],
        # Host batching included, as a user's loop has it.
        "tokens_per_s": (args.steps - 1) * args.batch * args.context / seconds,
        "params": params,
    }


def gradient_fidelity(params, args, data, scale):
    """float16 gradients against float32 ones at `params`, on one fixed batch."""
    x, y = next(batches(data, args.batch, args.context, 12345))

    def grads(compute, loss_scale):
        model = model_for(args, compute)
        loss_fn = lambda p: cross_entropy(model.apply({"params": p}, x), y)  # noqa: E731
        _, g = jax.jit(lossscale.value_and_grad(loss_fn))(loss_scale, params)
        return lossscale.unscale_grads(g, loss_scale)

    exact = grads(F32, lossscale.NoOpLossScale())
    report = {}
    for name, loss_scale in [
        ("unscaled", lossscale.NoOpLossScale()),
        ("scaled", lossscale.StaticLossScale(scale)),
    ]:
        low = grads(F16, loss_scale)
        report[name] = {"overall": _fidelity(exact, low)}
        for group in sorted(exact):
            report[name][group] = _fidelity(exact[group], low[group])
    return report


def _flat(tree):
    return np.concatenate(
        [np.ravel(np.asarray(g, np.float64)) for g in jax.tree.leaves(tree)]
    )


def _fidelity(exact, low):
    exact, low = _flat(exact), _flat(low)
    nonzero = exact != 0
    return {
        "relative_error": float(np.linalg.norm(low - exact) / np.linalg.norm(exact)),
        "underflow_share": float(np.mean((low == 0)[nonzero])),
    }


def main(argv=None):
    """Runs every precision and seed, then writes the results (`--out`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--float16-norms", action="store_true")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument(
        "--runs",
        default="float32,float16, no loss scaling,float16, dynamic loss scaling",
        help="comma-separated run names (of: float32, bfloat16, float16, no loss"
        " scaling, float16, dynamic loss scaling)",
    )
    parser.add_argument("--quick", action="store_true", help="no plot")
    parser.add_argument("--out", default="benchmarks/results/language_model")
    args = parser.parse_args(argv)
    data, held_out = corpus()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    results = {"args": vars(args), "jax": jax.__version__, "runs": {}}
    start = time.perf_counter()
    runs = [name for name in RUNS if name in args.runs]
    for seed in (int(s) for s in args.seeds.split(",")):
        for name in runs:
            run = train(name, args, data, held_out, seed)
            params = run.pop("params")
            results["runs"].setdefault(name, {})[seed] = run
            if name == "float32":
                fidelity_params = params
            print(
                f"seed {seed} {name:30s} held-out {run['held_out_loss']:.4f}"
                f" skipped {run['skipped_steps']:3d} scale {run['final_scale']:g}"
                f" {run['tokens_per_s']:.0f} tokens/s"
                f" ({time.perf_counter() - start:.0f}s)",
                file=sys.stderr,
            )
            with open(args.out + ".partial.json", "w") as f:  # a run cut short
                json.dump(results, f)
        if seed == int(args.seeds.split(",")[0]):
            results["fidelity"] = gradient_fidelity(
                fidelity_params, args, data, 2.0**15
            )
    write(results, args)
    return results


def write(results, args):
    """Writes the results as `.json`, `.md` and the loss curves' `.png`."""
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(results, f)
    lines = [
        "# Byte-level transformer language model, float16",
        "",
        f"`python {' '.join(sys.argv)}`: jax {results['jax']}, {jax.default_backend()},"
        f" ({jax.devices()[0].device_kind}), {args.layers} blocks of width"
        f" {args.width}, {args.steps} steps of {args.batch} x {args.context} bytes,"
        " Adam (warmup, cosine decay, clipping at 1), layer norms and softmax in"
        f" {'float16' if args.float16_norms else 'float32'}. Tokens/s: the steps"
        " after the first (which compiles), host batching included.",
        "",
        "| run | held-out loss per seed (nats/byte) | mean | skipped steps |"
        " final scale | tokens/s per seed |",
        "|---|---|---|---|---|---|",
    ]
    for name, seeds in results["runs"].items():
        held = [run["held_out_loss"] for run in seeds.values()]
        skipped = ", ".join(str(run["skipped_steps"]) for run in seeds.values())
        scales = ", ".join(f"{run['final_scale']:g}" for run in seeds.values())
        speed = ", ".join(f"{run['tokens_per_s']:.3g}" for run in seeds.values())
        lines.append(
            f"| {name} | {', '.join(f'{h:.4f}' for h in held)} | {np.mean(held):.4f} |"
            f" {skipped} | {scales} | {speed} |"
        )
    lines += [
        "",
        "Gradient fidelity at the float32 run's final parameters (first seed), one"
        " batch: float16 against float32.",
        "",
        "| part | unscaled: relative error | unscaled: underflow share |"
        " scaled (2^15): relative error | scaled: underflow share |",
        "|---|---|---|---|---|",
    ]
    fidelity = results["fidelity"]
    for group in fidelity["unscaled"]:
        u, s = fidelity["unscaled"][group], fidelity["scaled"][group]
        lines.append(
            f"| {group} | {u['relative_error']:.2%} | {u['underflow_share']:.2%} |"
            f" {s['relative_error']:.2%} | {s['underflow_share']:.2%} |"
        )
    table = "\n".join(lines) + "\n"
    with open(args.out + ".md", "w") as f:
        f.write(table)
    print(table)
    if not args.quick:
        plot(results, args.out + ".png")


def plot(results, path):
    """Plots each run's held-out loss against the step to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 4))
    for name, seeds in results["runs"].items():
        first = next(iter(seeds.values()))
        losses = np.convolve(first["losses"], np.ones(10) / 10, mode="valid")
        axes[0].plot(losses, label=name)
        axes[1].plot(first["scales"], label=name)
    axes[0].set(title="training loss (10-step mean), first seed", xlabel="step")
    axes[1].set(title="loss scale", xlabel="step", yscale="log")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


if __name__ == "__main__":
    main()
