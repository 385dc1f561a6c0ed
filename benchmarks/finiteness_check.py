"""Formulations of the finiteness check, per dtype: time, XLA bytes, and whether
each one finds a NaN, an inf and a -inf anywhere, and a NaN in one shard.

    python benchmarks/finiteness_check.py [--sizes 1M,10M,50M] [--rounds 7]

The check reads every gradient once per step, so its formulation decides how much
it costs. Each formulation is jit-compiled over 50 leaves (as the optimizer
benchmark), called back to back several times per round, timed interleaved with the
others in one process (median over rounds), and probed with one NaN, -NaN, inf or
-inf at the first, middle and last element of a leaf. Then, in a process of eight
host devices, with one NaN in one shard of a (64, 256) leaf split over its rows and
over its columns under `jax.jit` (a reduction whose devices' results are combined
by a `max` loses it on XLA:CPU). Results: a table on stdout and
`benchmarks/results/finiteness_check.md` (`--out`); why lossscale uses what it uses
is in `docs/design.md`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
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
    # What lossscale's XLA:CPU form uses for float16 and bfloat16 leaves.
    "any(~isfinite(x)) in lax": lambda x: (
        ~jax.lax.reduce_or(~jax.lax.is_finite(x), tuple(range(x.ndim)))
    ),
    "isfinite(sum(float32(x - x))) in lax": lambda x: jax.lax.is_finite(
        jax.lax.reduce_sum(
            jax.lax.convert_element_type(x - x, jnp.float32), tuple(range(x.ndim))
        )
    ),
}


def sharded_probe():
    """{dtype: {formulation: finds a NaN in one shard, rows and columns}}: 8 devices."""
    from jax.sharding import Mesh
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(jax.devices()[:8], ("d",))
    found = {}
    for dtype in (jnp.float32, jnp.float16, jnp.bfloat16):
        leaf = jnp.ones((64, 256), dtype).at[27, 100].set(jnp.nan)  # device 3's
        row = found.setdefault(jnp.dtype(dtype).name, {})
        for name, check in FORMULATIONS.items():
            placed = [
                jax.device_put(leaf, NamedSharding(mesh, s))
                for s in (P("d", None), P(None, "d"))
            ]
            try:
                finds = all(not bool(jax.jit(check)(v)) for v in placed)
                row[name] = "yes" if finds else "**no**"
            except Exception as error:  # a reducer XLA cannot partition
                row[name] = f"fails: {str(error).splitlines()[0][:60]}"
    return found


def sharded_results():
    """`sharded_probe()` in a process of its own, with eight host devices."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
    out = subprocess.run(
        [sys.executable, __file__, "--sharded-probe"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


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
    parser.add_argument("--sharded-probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sharded_probe:
        print(json.dumps(sharded_probe()))
        return
    sharded = sharded_results()
    lines = [
        "# Finiteness check formulations",
        "",
        f"`python {' '.join(sys.argv)}`: jax {jax.__version__},"
        f" {jax.default_backend()} ({jax.devices()[0].device_kind},"
        f" {os.cpu_count()} CPUs). 50 leaves; time is the median over"
        f" {args.rounds} interleaved rounds. Sharded: one NaN in one shard of a"
        " (64, 256) leaf split over 8 host devices by rows and by columns, under"
        " `jax.jit`.",
        "",
        "| size | dtype | formulation | time ms | bytes / leaf bytes | temp MB |"
        " finds NaN, inf, -inf | finds a NaN in one shard |",
        "|---|---|---|---|---|---|---|---|",
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
            found = sharded[jnp.dtype(dtype).name]
            for _, row in built:
                lines.append(
                    f"| {size} | {jnp.dtype(dtype).name} | `{row['formulation']}` |"
                    f" {1e3 * np.median(times[row['formulation']]):.2f} |"
                    f" {row['bytes'] / leaf_bytes:.2f} |"
                    f" {row['temp_bytes'] / 1e6:.1f} |"
                    f" {'yes' if row['finds_nan_inf'] else '**no**'} |"
                    f" {found[row['formulation']]} |"
                )
            print(f"done: {size} {jnp.dtype(dtype).name}", file=sys.stderr)
    table = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
