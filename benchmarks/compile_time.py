"""Compile time at model scale: lossscale, plain Adam and the peers, by leaf count.

    pip install -e ".[bench]"
    python benchmarks/compile_time.py [--leaves 100,300,1000,3000]
                                      [--grad-dtypes float32,bfloat16] [--repeats 1]

Real models have hundreds to thousands of parameter leaves. Every variant of
`optimizer_step.py` (plain Adam, `wrap`, `apply_gradients`, `TrainState` and the
peers) is built for a tree of N float32 parameter leaves of shape 64x16 with
gradients of the given dtype, and its jitted step (donated buffers) is traced,
lowered and compiled, all in one process. Before the measured runs, every variant
is compiled once at 10 leaves, so that no variant pays for JAX's shared caches
alone. Reported per variant: the time to trace and lower, the time to compile, their
sum and its ratio to plain Adam's and to `optax.apply_if_finite`'s at the same N,
and XLA's figures of the compiled step: HLO instructions, fusions and bytes
accessed. The slope is a least-squares fit of the total time against N (ms per
leaf). A peer that fails is reported as failed, with the reason; a variant capped
by `--cap` (Flax's recipe and mpx, whose compile time grows much faster than
linearly: 48 s at 300 leaves) is not run above its cap.
Results: a table on stdout and `benchmarks/results/compile_time.{json,md}` (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import lossscale  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import optimizer_step  # noqa: E402

BASELINE = "plain optax step (baseline)"
PEER = "optax.apply_if_finite(tx)"
# The select study is a study of runtime, not a way to train.
SKIPPED = ("study: one call with a select, not a cond",)
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%\S+ = ", re.M)


def make_trees(leaves: int, grad_dtype) -> tuple[dict, dict]:
    key = jax.random.key(0)
    params = {
        f"p{i:04d}": jax.random.normal(jax.random.fold_in(key, i), (64, 16)) * 0.01
        for i in range(leaves)
    }
    grads = {
        name: (p * optimizer_step.SCALE).astype(grad_dtype)
        for name, p in params.items()
    }
    return params, grads


def measure(make, params, grads) -> dict:
    """Trace and lower, then compile, the jitted step; XLA's figures of it."""
    params = jax.tree.map(jnp.copy, params)
    step, state = make(params)
    jitted = jax.jit(step, donate_argnums=(0, 1))
    start = time.perf_counter()
    lowered = jitted.lower(params, state, grads)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    text = compiled.as_text()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {
        "lower_s": lowered_at - start,
        "compile_s": compiled_at - lowered_at,
        "total_s": compiled_at - start,
        "instructions": len(_INSTRUCTION.findall(text)),
        "fusions": text.count(" fusion("),
        "bytes_accessed": float(cost.get("bytes accessed", np.nan)),
    }


def run(names, leaves, grad_dtype, repeats, caps=None) -> list[dict]:
    params, grads = make_trees(leaves, grad_dtype)
    rows = []
    for name in names:
        print(f"  {leaves} leaves, {grad_dtype}: {name}", file=sys.stderr, flush=True)
        row = {"leaves": leaves, "grad_dtype": str(grad_dtype), "variant": name}
        cap = min((n for part, n in (caps or {}).items() if part in name), default=None)
        if cap is not None and leaves > cap:
            row["error"] = f"not run above {cap} leaves (--cap)"
            rows.append(row)
            continue
        try:
            results = [
                measure(optimizer_step.VARIANTS[name], params, grads)
                for _ in range(repeats)
            ]
            row.update(min(results, key=lambda r: r["total_s"]))
            row["error"] = None
        except Exception as error:  # a failing peer is reported, not dropped
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:140]}"
        rows.append(row)
    base = {r["variant"]: r for r in rows}
    for row in rows:
        if row["error"]:
            continue
        for key, ref in (("adam_ratio", BASELINE), ("peer_ratio", PEER)):
            ok = ref in base and not base[ref]["error"]
            row[key] = row["total_s"] / base[ref]["total_s"] if ok else np.nan
    return rows


def slopes(rows) -> dict:
    """ms per leaf: the least-squares slope of total time against leaves."""
    out = {}
    for key in {(r["variant"], r["grad_dtype"]) for r in rows}:
        points = [
            (r["leaves"], r["total_s"])
            for r in rows
            if (r["variant"], r["grad_dtype"]) == key and not r["error"]
        ]
        if len(points) >= 2:
            x, y = np.array(points, dtype=float).T
            out[key] = 1e3 * float(np.polyfit(x, y, 1)[0])
    return out


def write(rows, out: str, argv) -> None:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    meta = {
        "command": " ".join(["python", "benchmarks/compile_time.py", *argv]),
        "jax": jax.__version__,
        "optax": optax.__version__,
        "lossscale": lossscale.__version__,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "cpu_count": os.cpu_count(),
    }
    fitted = slopes(rows)
    with open(out + ".json", "w") as f:
        json.dump(
            {
                "meta": meta,
                "rows": rows,
                "slopes_ms_per_leaf": {f"{v} | {d}": s for (v, d), s in fitted.items()},
            },
            f,
            indent=1,
        )
    lines = [
        "# Compile time at model scale",
        "",
        f"`{meta['command']}`: jax {meta['jax']}, optax {meta['optax']},"
        f" {meta['backend']} ({meta['device']}, {meta['cpu_count']} CPUs), lossscale"
        f" {meta['lossscale']}. Parameter leaves of 64x16 (float32); one process;"
        " times in seconds; ratios of the total (trace, lower and compile) to plain"
        " Adam's and to `optax.apply_if_finite`'s at the same leaf count and dtype.",
        "",
        "| leaves | grads | variant | trace+lower s | compile s | total s | / Adam |"
        " / apply_if_finite | HLO instructions | fusions | bytes / Adam's |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base_bytes = {
        (r["leaves"], r["grad_dtype"]): r.get("bytes_accessed")
        for r in rows
        if r["variant"] == BASELINE and not r["error"]
    }
    for r in rows:
        head = f"| {r['leaves']} | {r['grad_dtype']} | {r['variant']} |"
        if r["error"]:
            lines.append(f"{head} failed: {r['error']} | | | | | | | |")
            continue
        ref = base_bytes.get((r["leaves"], r["grad_dtype"]), np.nan)
        lines.append(
            f"{head} {r['lower_s']:.2f} | {r['compile_s']:.2f} | {r['total_s']:.2f} |"
            f" {r['adam_ratio']:.2f}x | {r['peer_ratio']:.2f}x | {r['instructions']}"
            f" | {r['fusions']} | {r['bytes_accessed'] / ref:.3f}x |"
        )
    lines += [
        "",
        "Slope of the total time against the leaf count (least squares), ms per leaf:",
        "",
        "| variant | grads | ms per leaf |",
        "|---|---|---|",
    ]
    for (variant, dtype), slope in sorted(fitted.items()):
        lines.append(f"| {variant} | {dtype} | {slope:.2f} |")
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", default="100,300,1000,3000")
    parser.add_argument("--grad-dtypes", default="float32,bfloat16")
    parser.add_argument("--variants", default="", help="comma-separated substrings")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/compile_time")
    parser.add_argument(
        "--cap",
        default="Flax DynamicScale=300,mpx=300",
        help="variant substring=most leaves, comma-separated: variants whose compile"
        " time grows too fast to wait for (48 s at 300 leaves, on a 2-core CPU)",
    )
    args = parser.parse_args(argv)
    caps = {
        part: int(n)
        for part, n in (item.rsplit("=", 1) for item in args.cap.split(",") if item)
    }
    names = [
        name
        for name in optimizer_step.VARIANTS
        if name not in SKIPPED
        and (
            not args.variants
            or name in (BASELINE, PEER)
            or any(part in name for part in args.variants.split(","))
        )
    ]
    print("warming JAX's caches at 10 leaves", file=sys.stderr)
    for grad_dtype in args.grad_dtypes.split(","):
        run(names, 10, jnp.dtype(grad_dtype), 1)
    rows = []
    for leaves in map(int, args.leaves.split(",")):
        for grad_dtype in args.grad_dtypes.split(","):
            rows += run(names, leaves, jnp.dtype(grad_dtype), args.repeats, caps)
            write(rows, args.out, argv)
    with open(args.out + ".md") as f:
        print(f.read())


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception:  # pragma: no cover - a report beats a stack trace
        traceback.print_exc()
        sys.exit(1)
