"""Demo: float16 training with and without loss scaling on scikit-learn's digits.

Run it with `python -m lossscale.demo` (needs the `demo` extra: scikit-learn, and
matplotlib for the plot).

The same deep sigmoid MLP (float32 parameters) is trained three ways on the full
training set (one mean over 1437 images per step), with Adam and a warmup and
cosine decay schedule: computing in float32, in float16 without loss scaling, and in
float16 with dynamic loss scaling through `lossscale.wrap`. Sigmoids shrink
gradients by up to 4x per layer and the mean divides each image's gradient by 1437,
so the lower layers' gradients are far below float16's smallest subnormal (2**-24):
without loss scaling they become exactly zero and those layers never train. No
gradient is multiplied to make this happen; it is the depth and the mean.

The table reports the training loss (the mean over the last 50 steps, after the
learning rate has decayed, so that no single step decides it), the test accuracy at
the end, skipped steps, the final scale, and the share of gradient elements that
are non-zero in float32 but exactly zero in the run's precision. A PNG plots the
loss, the scale and the share of exactly-zero gradient elements over training.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lossscale

RUNS = (
    ("float32", jnp.float32, None),
    ("float16, no loss scaling", jnp.float16, None),
    ("float16, dynamic loss scaling", jnp.float16, "dynamic"),
)
SIZES = (64,) + (64,) * 8 + (10,)  # eight sigmoid layers of 64 units


def load_digits(seed: int):
    """Digits scaled to [0, 1], split 80/20 into train and test sets."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        raise SystemExit(
            "The demo needs scikit-learn: pip install 'lossscale[demo]'"
        ) from None
    data = sklearn_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    split = int(0.8 * len(x))
    train, test = order[:split], order[split:]
    return (x[train], y[train]), (x[test], y[test])


def init_mlp(key: jax.Array, sizes: tuple[int, ...]) -> list[dict[str, jax.Array]]:
    """Float32 master parameters (LeCun normal initialisation)."""
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:], strict=True):
        key, subkey = jax.random.split(key)
        scale = jnp.sqrt(jnp.float32(1.0 / fan_in))
        params.append(
            {
                "w": jax.random.normal(subkey, (fan_in, fan_out), jnp.float32) * scale,
                "b": jnp.zeros((fan_out,), jnp.float32),
            }
        )
    return params


def logits_fn(params: Any, x: jax.Array, dtype: Any) -> jax.Array:
    """The network, computing in `dtype` from float32 master parameters."""
    h = x.astype(dtype)
    for layer in params[:-1]:
        h = jax.nn.sigmoid(h @ layer["w"].astype(dtype) + layer["b"].astype(dtype))
    return h @ params[-1]["w"].astype(dtype) + params[-1]["b"].astype(dtype)


def loss_fn(params: Any, x: jax.Array, y: jax.Array, dtype: Any) -> jax.Array:
    """Mean cross-entropy over the batch; the loss itself in float32."""
    logits = logits_fn(params, x, dtype).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def train(
    dtype: Any,
    loss_scale: Any,
    data,
    *,
    steps: int,
    seed: int,
    progress=None,
) -> dict[str, Any]:
    """Trains one configuration with full-batch Adam; returns its history."""
    (x_train, y_train), (x_test, y_test) = data
    params = init_mlp(jax.random.key(seed), SIZES)
    # Warmup, then cosine decay to 1%: full-batch Adam at a constant 3e-3 spiked
    # again and again, and a run's last step could land on a spike.
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, 3e-3, warmup_steps=max(steps // 20, 1), decay_steps=steps, end_value=3e-5
    )
    tx = lossscale.wrap(optax.adam(schedule), loss_scale)
    opt_state = tx.init(params)
    x_train, y_train = jnp.asarray(x_train), jnp.asarray(y_train)

    @jax.jit
    def step(params, opt_state):
        loss, grads = lossscale.value_and_grad(loss_fn)(
            opt_state, params, x_train, y_train, dtype
        )
        stats = lossscale.diagnostics.grad_stats(
            lossscale.unscale_grads(grads, opt_state)
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        scale = lossscale.metrics(opt_state)["loss_scale"]
        record = (loss, scale, stats["zero_fraction"])
        return optax.apply_updates(params, updates), opt_state, record

    records = []
    for index in range(steps):
        params, opt_state, record = step(params, opt_state)
        records.append(record)  # arrays: no host sync inside the loop
        if progress is not None:
            progress(index + 1)
    losses, scales, zeros = (
        np.asarray(jnp.stack(r)) for r in zip(*records, strict=True)
    )
    accuracy = jnp.mean(
        jnp.argmax(logits_fn(params, jnp.asarray(x_test), dtype), -1) == y_test
    )
    metrics = {k: v.item() for k, v in lossscale.metrics(opt_state).items()}
    return {
        "losses": losses,
        "scales": scales,
        "zero_fraction": zeros,
        "final_loss": float(np.mean(losses[-50:])),
        "accuracy": float(accuracy),
        "skipped_steps": metrics["skipped_steps"],
        "loss_scale": metrics["loss_scale"],
        "params": params,
        "final_state": lossscale.get_loss_scale(opt_state),
    }


def underflow_share(params: Any, dtype: Any, loss_scale: Any, x, y) -> float:
    """Share of gradient elements non-zero in float32 but exactly zero in `dtype`.

    `loss_scale` is the run's final loss-scale state: the share is measured at
    the scale the run ended with.
    """

    @jax.jit
    def counts(params, loss_scale, x, y):
        # One program: op by op, the two gradients and the counts compile ~100
        # small programs, several seconds of a short run.
        def grads_for(dtype, loss_scale):
            _, grads = lossscale.value_and_grad(loss_fn)(
                loss_scale, params, x, y, dtype
            )
            return jax.tree.leaves(lossscale.unscale_grads(grads, loss_scale))

        exact = grads_for(jnp.float32, lossscale.NoOpLossScale())
        low = grads_for(dtype, loss_scale)
        nonzero = sum(jnp.count_nonzero(g) for g in exact)
        lost = sum(
            jnp.sum((exact_leaf != 0) & (low_leaf == 0))
            for exact_leaf, low_leaf in zip(exact, low, strict=True)
        )
        return nonzero, lost

    nonzero, lost = (int(n) for n in counts(params, loss_scale, x, y))
    return lost / max(nonzero, 1)


class ProgressBar:
    """A one-line text progress bar on stderr (no dependency)."""

    def __init__(self, label: str, total: int, width: int = 30):
        self.label, self.total, self.width = label, total, width
        self.start = time.perf_counter()

    def __call__(self, done: int) -> None:
        """Redraws the bar after `done` of `total` steps (about 100 redraws)."""
        if done != self.total and done % max(self.total // 100, 1):
            return
        filled = int(self.width * done / self.total)
        bar = "#" * filled + "-" * (self.width - filled)
        seconds = time.perf_counter() - self.start
        end = "\n" if done == self.total else ""
        print(
            f"\r{self.label:32s} [{bar}] {done}/{self.total} {seconds:5.1f}s",
            end=end,
            file=sys.stderr,
            flush=True,
        )


def plot(results: dict[str, dict[str, Any]], path: str) -> bool:
    """Saves the loss, scale and zero-gradient curves; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, result in results.items():
        axes[0].plot(result["losses"], label=name)
        axes[1].plot(result["scales"], label=name)
        axes[2].plot(result["zero_fraction"], label=name)
    axes[0].set(title="training loss", xlabel="step", yscale="log")
    axes[1].set(title="loss scale", xlabel="step", yscale="log")
    axes[2].set(title="share of gradient elements exactly zero", xlabel="step")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Runs the three trainings, prints the comparison table, saves the plot."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="lossscale_demo.png", help="PNG path")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")

    data = load_digits(args.seed)
    (x_train, y_train), _ = data
    results = {}
    for name, dtype, loss_scale in RUNS:
        result = train(
            dtype,
            loss_scale,
            data,
            steps=args.steps,
            seed=args.seed,
            progress=ProgressBar(name, args.steps),
        )
        result["underflow"] = underflow_share(
            result["params"], dtype, result["final_state"], x_train, y_train
        )
        results[name] = result

    header = (
        f"{'run':32s} {'train loss':>10s} {'test acc':>9s} {'skipped':>8s}"
        f" {'final scale':>12s} {'underflow':>10s}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for name, r in results.items():
        print(
            f"{name:32s} {r['final_loss']:10.3f} {r['accuracy']:9.3f}"
            f" {r['skipped_steps']:8d} {r['loss_scale']:12.0f} {r['underflow']:10.2%}"
        )
    print(
        "\nunderflow: share of gradient elements that are non-zero in float32 but"
        " exactly zero in the run's precision, on the training set at the end."
    )
    if plot(results, args.plot):
        print(f"plot saved to {args.plot}")
    else:
        print("plot skipped: pip install matplotlib (or 'lossscale[demo]')")
    return results


if __name__ == "__main__":
    main()
