"""Demo: float16 training with and without loss scaling on scikit-learn's digits.

Run it with `python -m lossscale.demo` (needs the `demo` extra: scikit-learn).

The same MLP (float32 parameters) is trained three ways: computing in float32, in
float16 without loss scaling, and in float16 with dynamic loss scaling through
`lossscale.wrap`. The table reports the final training loss, the test accuracy,
skipped steps, the final scale, and how many gradient elements that are non-zero
in float32 came out as exactly zero in float16 (underflow) on a fixed batch.
"""

from __future__ import annotations

import argparse
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
    """Float32 master parameters (He initialisation)."""
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:], strict=True):
        key, subkey = jax.random.split(key)
        scale = jnp.sqrt(jnp.float32(2.0 / fan_in))
        params.append(
            {
                "w": jax.random.normal(subkey, (fan_in, fan_out), jnp.float32) * scale,
                "b": jnp.zeros((fan_out,), jnp.float32),
            }
        )
    return params


def loss_fn(params: Any, x: jax.Array, y: jax.Array, dtype: Any) -> jax.Array:
    """Mean cross-entropy; the network computes in `dtype`, the loss in float32."""
    h = x.astype(dtype)
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"].astype(dtype) + layer["b"].astype(dtype))
    logits = h @ params[-1]["w"].astype(dtype) + params[-1]["b"].astype(dtype)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), y
    ).mean()


def train(
    dtype: Any,
    loss_scale: Any,
    data,
    *,
    steps: int,
    batch_size: int,
    seed: int,
    sizes: tuple[int, ...],
) -> dict[str, Any]:
    """Trains one configuration; returns its losses and final figures."""
    (x_train, y_train), (x_test, y_test) = data
    params = init_mlp(jax.random.key(seed), sizes)
    tx = lossscale.wrap(optax.adam(1e-3), loss_scale)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        def scaled_loss(params):
            loss = loss_fn(params, x, y, dtype)
            return lossscale.scale_loss(loss, opt_state), loss

        grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        batch = rng.integers(0, len(x_train), batch_size)
        x, y = x_train[batch], y_train[batch]
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(loss)
    losses = np.asarray(jnp.stack(losses))

    @jax.jit
    def accuracy(params):
        h = jnp.asarray(x_test).astype(dtype)
        for layer in params[:-1]:
            h = jax.nn.relu(h @ layer["w"].astype(dtype) + layer["b"].astype(dtype))
        logits = h @ params[-1]["w"].astype(dtype) + params[-1]["b"].astype(dtype)
        return jnp.mean(jnp.argmax(logits, axis=-1) == jnp.asarray(y_test))

    metrics = {k: v.item() for k, v in lossscale.metrics(opt_state).items()}
    return {
        "losses": losses,
        "final_loss": float(np.mean(losses[-50:])),
        "accuracy": float(accuracy(params)),
        "skipped_steps": metrics["skipped_steps"],
        "loss_scale": metrics["loss_scale"],
        "params": params,
    }


def underflow_share(params: Any, dtype: Any, loss_scale: Any, x, y) -> float:
    """Share of gradient elements non-zero in float32 but exactly zero in `dtype`."""

    def grads_for(dtype, loss_scale):
        grads = jax.grad(
            lambda p: lossscale.scale_loss(loss_fn(p, x, y, dtype), loss_scale)
        )(params)
        return lossscale.unscale_grads(grads, loss_scale)

    exact = jax.tree.leaves(grads_for(jnp.float32, None))
    low = jax.tree.leaves(grads_for(dtype, loss_scale))
    nonzero = sum(int(jnp.count_nonzero(g)) for g in exact)
    lost = sum(
        int(jnp.sum((exact_leaf != 0) & (low_leaf == 0)))
        for exact_leaf, low_leaf in zip(exact, low, strict=True)
    )
    return lost / max(nonzero, 1)


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Runs the three trainings and prints the comparison table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    data = load_digits(args.seed)
    sizes = (64, 256, 256, 256, 10)
    (x_train, y_train), _ = data
    probe = (x_train[: args.batch_size], y_train[: args.batch_size])
    results = {}
    for name, dtype, loss_scale in RUNS:
        start = time.perf_counter()
        print(f"training: {name} ({args.steps} steps) ...", flush=True)
        result = train(
            dtype,
            loss_scale,
            data,
            steps=args.steps,
            batch_size=args.batch_size,
            seed=args.seed,
            sizes=sizes,
        )
        result["underflow"] = underflow_share(
            result["params"], dtype, loss_scale, *probe
        )
        result["seconds"] = time.perf_counter() - start
        results[name] = result

    header = (
        f"{'run':32s} {'train loss':>10s} {'test acc':>9s} {'skipped':>8s}"
        f" {'final scale':>12s} {'underflow':>10s}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for name, r in results.items():
        print(
            f"{name:32s} {r['final_loss']:10.2e} {r['accuracy']:9.3f}"
            f" {r['skipped_steps']:8d} {r['loss_scale']:12.0f} {r['underflow']:10.2%}"
        )
    print(
        "\nunderflow: share of gradient elements that are non-zero in float32 but"
        " exactly zero in the run's precision, on one batch at the end of training."
    )
    return results


if __name__ == "__main__":
    main()
