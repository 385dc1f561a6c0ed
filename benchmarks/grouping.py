"""The finiteness check over many small leaves: one reduction per leaf, or per group.

    python benchmarks/grouping.py [--leaves 100,300,1000] [--dtypes bfloat16,float32]

`lossscale.all_finite` over N leaves of 64x16 (fewer elements than
`forms.GROUP_BELOW`), jitted, as shipped (small leaves stacked by shape and
dtype, one `sum(x - x)` per stack) and with grouping turned off
(`GROUP_BELOW = 0`: each leaf reduced on its own, as lossscale 0.2 did, with the
per-leaf results stacked into one `all`), and as shipped but with 16-bit stacks
reduced by `max` and `min`. Reported: compile time, the median time of a call
over 30, XLA's bytes accessed per byte of input, and the reductions in the
lowered program. Results: a table on stdout and
`benchmarks/results/grouping.{json,md}` (`--out`). `--per-leaf-up-to` skips the
per-leaf variant above that many leaves (its compile time grows faster than
linearly: minutes at 1000 leaves on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import lossscale
from lossscale._src.step import forms


def max_min_stacks(leaves):
    """As shipped, but 16-bit stacks are reduced by max and min (two reads)."""
    large, small = [], {}
    for leaf in map(jnp.asarray, leaves):
        if leaf.size < forms.GROUP_BELOW:
            small.setdefault((leaf.shape, leaf.dtype), []).append(leaf)
        else:
            large.append(leaf)
    stacks = [jnp.stack(group) for group in small.values()]
    checks = [jnp.isfinite(jnp.sum(v - v)) for v in large if v.dtype.itemsize >= 4]
    checks += [
        jnp.isfinite(jnp.max(v)) & jnp.isfinite(jnp.min(v))
        for v in large + stacks
        if v.dtype.itemsize < 4
    ]
    checks += [jnp.isfinite(jnp.sum(v - v)) for v in stacks if v.dtype.itemsize >= 4]
    return jnp.all(jnp.stack(checks))


def measure(check, tree) -> dict:
    fn = jax.jit(check)
    start = time.perf_counter()
    lowered = fn.lower(tree)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    compiled(tree).block_until_ready()
    times = []
    for _ in range(30):
        start = time.perf_counter()
        compiled(tree).block_until_ready()
        times.append(time.perf_counter() - start)
    input_bytes = sum(leaf.nbytes for leaf in tree)
    return {
        "compile_s": compile_s,
        "median_ms": 1e3 * float(np.median(times)),
        "bytes_per_input_byte": float(cost["bytes accessed"]) / input_bytes,
        "reductions": len(re.findall(r"stablehlo\.reduce\b", lowered.as_text())),
    }


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", default="100,300,1000")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--per-leaf-up-to", type=int, default=300)
    parser.add_argument("--out", default="benchmarks/results/grouping")
    args = parser.parse_args(argv)
    shipped = forms.GROUP_BELOW

    def per_leaf(tree):
        forms.GROUP_BELOW = 0
        try:
            return lossscale.all_finite(tree)
        finally:
            forms.GROUP_BELOW = shipped

    variants = {
        "grouped, sum(x - x) (shipped)": lossscale.all_finite,
        "grouped, max and min for 16-bit stacks": max_min_stacks,
        "per leaf (grouping off)": per_leaf,
    }
    rows = []
    for leaves in map(int, args.leaves.split(",")):
        for dtype in args.dtypes.split(","):
            tree = [jnp.full((64, 16), i, jnp.dtype(dtype)) for i in range(leaves)]
            for name, check in variants.items():
                if name.startswith("per leaf") and leaves > args.per_leaf_up_to:
                    continue
                print(f"  {leaves} {dtype}: {name}", file=sys.stderr, flush=True)
                rows.append(
                    {"leaves": leaves, "dtype": dtype, "variant": name}
                    | measure(check, tree)
                )
    meta = {
        "command": " ".join(["python", "benchmarks/grouping.py", *argv]),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "cpu_count": os.cpu_count(),
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [
        "# The finiteness check over many small leaves",
        "",
        f"`{meta['command']}`: jax {meta['jax']}, {meta['backend']},"
        f" {meta['cpu_count']} CPUs; leaves of 64x16.",
        "",
        "| leaves | dtype | variant | compile s | median ms | bytes / input byte |"
        " reductions |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['leaves']} | {r['dtype']} | {r['variant']} | {r['compile_s']:.2f} |"
        f" {r['median_ms']:.3f} | {r['bytes_per_input_byte']:.2f} | {r['reductions']} |"
        for r in rows
    ]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
