"""Which kernels an optimizer step runs, and what each costs: attribution on a device.

    python benchmarks/kernels.py [--size 10M] [--leaves 50] [--grad-dtype float32]
                                 [--variants wrap,apply_gradients] [--out DIR]

For the baseline (plain Adam) and each selected variant of `optimizer_step.py`, the
step is compiled with donated buffers, run, and traced with `jax.profiler`. The
device's kernels (on XLA:CPU, the thunks of its thread pool) are grouped by kind
(the name less its number):
count and microseconds per step, largest first. Beside the table, the optimized
HLO of each compiled step is written (`DIR/<variant>.hlo.txt`), so the kernels can
be read back to the fusions and instructions they run. Results: `DIR/kernels.md`
and `DIR/kernels.json`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import optimizer_step  # noqa: E402
import profiling  # noqa: E402
import report  # noqa: E402


def kernel_table(candidate: report.Candidate, steps: int) -> list[dict]:
    """Kernels by kind (name less its number): count and us per step, largest first."""
    events = profiling.kernel_events(candidate.run_step, steps)
    groups: dict[str, list[float]] = collections.defaultdict(list)
    for event in events:
        # `multiply_add_fusion.15` and `loop_add_fusion_3` group by their kind.
        kind = re.sub(r"[._]\d+$", "", event["name"])
        groups[kind].append(event.get("dur", 0.0))
    rows = [
        {"name": name, "count": len(d) / steps, "us": sum(d) / steps}
        for name, d in groups.items()
    ]
    return sorted(rows, key=lambda row: -row["us"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="10M")
    parser.add_argument("--leaves", type=int, default=50)
    parser.add_argument("--grad-dtype", default="float32")
    parser.add_argument("--variants", default="wrap(tx), dynamic,apply_gradients")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", default="benchmarks/results/kernels")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    total = report.parse_size(args.size)
    params = optimizer_step.make_tree(total, args.leaves, jnp.float32)
    grads = optimizer_step.make_tree(total, args.leaves, jnp.dtype(args.grad_dtype))
    grads = jax.tree.map(lambda g: g * optimizer_step.SCALE, grads)
    baseline = "plain optax step (baseline)"
    names = [baseline] + [
        name
        for name in optimizer_step.VARIANTS
        if name != baseline and any(p in name for p in args.variants.split(","))
    ]
    results = {}
    lines = [
        f"# Kernels per step: {args.size} params in {args.leaves} leaves,"
        f" {args.grad_dtype} grads",
        "",
        f"`python {' '.join(sys.argv)}`: jax {jax.__version__},"
        f" {jax.default_backend()} ({jax.devices()[0].device_kind}).",
    ]
    for name in names:
        candidate = report.Candidate(name, optimizer_step.VARIANTS[name], params, grads)
        if candidate.error:
            results[name] = {"error": candidate.error}
            lines += ["", f"## {name}", "", f"failed: {candidate.error}"]
            continue
        for _ in range(3):
            candidate.run_step(10)
        table = kernel_table(candidate, args.steps)
        hlo = (
            candidate.jitted.lower(candidate.params, candidate.state, candidate.grads)
            .compile()
            .as_text()
        )
        slug = re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")[:60]
        with open(os.path.join(args.out, f"{slug}.hlo.txt"), "w") as f:
            f.write(hlo)
        total_us = sum(row["us"] for row in table)
        count = sum(row["count"] for row in table)
        results[name] = {"kernels": table, "us_per_step": total_us, "count": count}
        lines += [
            "",
            f"## {name}: {count:.0f} kernels, {total_us:.1f} us per step",
            "",
            "| kernel | per step | us per step |",
            "|---|---|---|",
        ]
        for row in table[: args.top]:
            lines.append(
                f"| `{row['name'][:70]}` | {row['count']:.1f} | {row['us']:.1f} |"
            )
        del candidate
    with open(os.path.join(args.out, "kernels.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "kernels.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
