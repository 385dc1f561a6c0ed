"""How many bits an applied step of `wrap(tx, None)` shares with `tx`'s own step.

    python benchmarks/exactness.py [--steps 5]

Six float32 leaves (263,040 elements) take `--steps` steps of random gradients
through three jitted programs per optimizer (Adam, AdamW, SGD with Nesterov
momentum): `lossscale.wrap(tx, loss_scale)` for `loss_scale` None and 1.0;
`tx.update` alone; and `tx.update` in a `lax.cond` branch on the gradients'
finiteness, with the updates applied after it (what `wrap` runs). Reported, per
step: how many float32 elements of the parameters and optimizer state differ
from each reference, and the largest difference in units of the reference
value's leaf-wide largest magnitude. Results: a table on stdout and
`benchmarks/results/exactness_<backend>.md`.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lossscale

OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3, weight_decay=1e-2),
    "sgd_nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
}


def programs(inner, loss_scale):
    tx = lossscale.wrap(inner, loss_scale)

    def with_updates(update):
        def step(params, state, grads):
            updates, state = update(grads, state, params)
            return optax.apply_updates(params, updates), state

        return jax.jit(step)

    def in_cond(grads, state, params):
        finite = jnp.all(
            jnp.stack([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)])
        )
        return jax.lax.cond(
            finite,
            lambda g, s, p: inner.update(g, s, p),
            lambda g, s, p: (jax.tree.map(jnp.zeros_like, g), s),
            grads,
            state,
            params,
        )

    return (
        tx,
        with_updates(tx.update),
        with_updates(inner.update),
        with_updates(in_cond),
    )


def float_elements(tree):
    leaves = [np.asarray(x) for x in jax.tree.leaves(tree) if x.dtype == jnp.float32]
    return leaves


def compare(ours, reference):
    differ, worst = 0, 0.0
    for a, b in zip(float_elements(ours), float_elements(reference), strict=True):
        differ += int(np.sum(a != b))
        scale = float(np.max(np.abs(b))) or 1.0
        worst = max(worst, float(np.max(np.abs(a - b))) / scale)
    return differ, worst


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    params = {
        f"p{i}": jnp.asarray(rng.normal(size=(300 + 17 * i, 128)), jnp.float32)
        for i in range(6)
    }
    size = sum(x.size for x in jax.tree.leaves(params))
    rows = []
    for name, make in OPTIMIZERS.items():
        for loss_scale in [None, 1.0]:
            inner = make()
            tx, ours, plain, in_cond = programs(inner, loss_scale)
            states = {
                "ours": (params, tx.init(params)),
                "plain": (params, inner.init(params)),
                "cond": (params, inner.init(params)),
            }
            for step in range(args.steps):
                grads = jax.tree.map(
                    lambda x: jnp.asarray(rng.normal(size=x.shape) * 1e-2, jnp.float32),
                    params,
                )
                for key, program in [
                    ("ours", ours),
                    ("plain", plain),
                    ("cond", in_cond),
                ]:
                    states[key] = program(*states[key], grads)
                p, s = states["ours"]
                ours_tree = (p, s.inner_state)
                plain_n, plain_worst = compare(ours_tree, states["plain"])
                cond_n, cond_worst = compare(ours_tree, states["cond"])
                rows.append(
                    (
                        name,
                        loss_scale,
                        step + 1,
                        plain_n,
                        plain_worst,
                        cond_n,
                        cond_worst,
                    )
                )
    lines = [
        f"`python benchmarks/exactness.py --steps {args.steps}`; jax {jax.__version__},"
        f" optax {optax.__version__}, {jax.default_backend()}; {size:,} parameters,"
        " float32 elements of params and optimizer state compared after each step.",
        "",
        "| optimizer | loss_scale | step | differ from `tx` | largest (rel.) |"
        " differ from `tx` in a cond | largest (rel.) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, loss_scale, step, plain_n, plain_worst, cond_n, cond_worst in rows:
        lines.append(
            f"| {name} | {loss_scale} | {step} | {plain_n:,} | {plain_worst:.1e} |"
            f" {cond_n:,} | {cond_worst:.1e} |"
        )
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        with open(f"{args.out}/exactness_{jax.default_backend()}.md", "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
