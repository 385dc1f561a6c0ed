"""Formulations of the finiteness check, per dtype: time, XLA bytes, and whether
each one finds a NaN, an inf and a -inf anywhere.

    python benchmarks/finiteness_check.py [--sizes 1M,10M,50M] [--rounds 7]

The check reads every gradient once per step, so its formulation decides how much
it costs. Each formulation is jit-compiled over 50 leaves (as the optimizer
benchmark), called back to back several times per round, timed interleaved with the
others in one process (median over rounds), and probed with one NaN, -NaN, inf or
-inf at the first, middle and last element of a leaf. Results: a table on stdout
and `benchmarks/results/finiteness_check.md` (`--out`); why lossscale uses what
it uses is in `docs/design.md`.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import report  # noqa: E402


def _zero_or_nan(a, b):
    return (a - a) + (b - b)


FORMULATIONS = {
    "isfinite(sum(x - x))": lambda x: jnp.isfinite(jnp.sum(x - x)),
    "isfinite(max(x)) & isfinite(min(x))": lambda x: (
        jnp.isfinite(jnp.max(x)) & jnp.isfinite(jnp.min(x))
    ),
    "all(isfinite(x))": lambda x: jnp.all(jnp.isfinite(x)),
    "reduce with (a - a) + (b - b)": lambda x: jnp.isfinite(
        jax.lax.reduce(x, jnp.zeros([], x.dtype), _zero_or_nan, tuple(range(x.ndim)))
    ),
    "all(isfinite(float32(x)))": lambda x: jnp.all(jnp.isfinite(x.astype(jnp.float32))),
}


def measure(name, check, leaves):
    fn = jax.jit(lambda ls: functools.reduce(jnp.logical_and, map(check, ls)))
    compiled = fn.lower(leaves).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    finds_all = bool(fn(leaves))
    for position in (0, leaves[3].size // 2, leaves[3].size - 1):
        for bad in (np.nan, -np.nan, np.inf, -np.inf):
            probe = list(leaves)
            probe[3] = probe[3].at[position].set(bad)
            finds_all &= not bool(fn(probe))
    return fn, {
        "formulation": name,
        "bytes": float(cost["bytes accessed"]),
        "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
        "finds_nan_inf": finds_all,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,10M,50M")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/finiteness_check")
    args = parser.parse_args(argv)
    lines = [
        "# Finiteness check formulations",
        "",
        f"`python {' '.join(sys.argv)}`: jax {jax.__version__},"
        f" {jax.default_backend()} ({jax.devices()[0].device_kind},"
        f" {os.cpu_count()} CPUs). 50 leaves; time is the median over"
        f" {args.rounds} interleaved rounds.",
        "",
        "| size | dtype | formulation | time ms | bytes / leaf bytes | temp MB |"
        " finds NaN, inf, -inf |",
        "|---|---|---|---|---|---|---|",
    ]
    for size in args.sizes.split(","):
        total = report.parse_size(size)
        for dtype in (jnp.float32, jnp.float16, jnp.bfloat16):
            rng = np.random.default_rng(0)
            leaves = [
                jnp.asarray(rng.standard_normal(total // 50), dtype) for _ in range(50)
            ]
            leaf_bytes = sum(leaf.nbytes for leaf in leaves)
            built = [measure(n, f, leaves) for n, f in FORMULATIONS.items()]
            times = {row["formulation"]: [] for _, row in built}
            calls = max(1, int(2e8 // total))  # about 0.1-1 s per round and row
            for _ in range(args.rounds):
                for fn, row in built:
                    start = time.perf_counter()
                    for _ in range(calls):
                        out = fn(leaves)
                    jax.block_until_ready(out)
                    elapsed = (time.perf_counter() - start) / calls
                    times[row["formulation"]].append(elapsed)
            for _, row in built:
                lines.append(
                    f"| {size} | {jnp.dtype(dtype).name} | `{row['formulation']}` |"
                    f" {1e3 * np.median(times[row['formulation']]):.2f} |"
                    f" {row['bytes'] / leaf_bytes:.2f} |"
                    f" {row['temp_bytes'] / 1e6:.1f} |"
                    f" {'yes' if row['finds_nan_inf'] else '**no**'} |"
                )
            print(f"done: {size} {jnp.dtype(dtype).name}", file=sys.stderr)
    table = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
