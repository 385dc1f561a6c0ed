"""Compile time at model scale: lossscale, plain Adam and the peers, by leaf count.

    pip install -e ".[bench]"
    python benchmarks/compile_time.py [--leaves 100,300,1000,3000]
                                      [--grad-dtypes float32,bfloat16] [--repeats 1]
    python benchmarks/compile_time.py --parts mlp,transformer --leaves 40,100,300,1000
    ~/aot-h100/bin/python benchmarks/compile_time.py --target h100   # no GPU needed

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
leaf). `--parts mlp,transformer` compile the whole float16 train step instead
(forward, backward and Adam, float32 parameters; the baseline is the same step
without loss scaling): a deep MLP of tanh layers of width 64 (two leaves a layer)
and `train_step.py`'s transformer, unscanned, at width 64 (six leaves a block, two
more). `--parts check` compiles the finiteness check alone (`lossscale.all_finite`)
against a `jnp.isfinite` reduction per leaf, `optax.apply_if_finite`'s check, the
baseline there. `--target h100` or `tpu-v5e`/`tpu-v5p` compiles for that device
without one (as `compiled.py`, in its virtual environment). A peer that fails is
reported as failed, with the reason; a variant capped by `--cap` (Flax's recipe and
mpx, whose compile time grows much faster than linearly: 48 s at 300 leaves) is not
run above its cap.
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
_given = [a for i, a in enumerate(sys.argv) if sys.argv[i - 1] == "--target"] + [
    a.split("=", 1)[1] for a in sys.argv if a.startswith("--target=")
]
if _given and _given[-1] != "cpu":  # `--clock cpu` is not a target
    # Compiled for a device this machine need not have: no driver or chip is
    # looked for, which must be said before JAX is imported (as compiled.py).
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import optimizer_step  # noqa: E402
import train_step  # noqa: E402

import lossscale  # noqa: E402

BASELINE = "plain optax step (baseline)"
PEER = "optax.apply_if_finite(tx)"
TRAIN_PEER = "optax.apply_if_finite(adam)"
# The select study is a study of runtime, not a way to train.
SKIPPED = ("study: one call with a select, not a cond",)
# `--clock cpu`: the process's CPU time (all its threads), which other work on a
# busy machine moves far less than the wall clock.
CLOCK = [time.perf_counter]
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


def deep_mlp(key, leaves: int, width: int = 64, batch: int = 32, compute=jnp.float16):
    """tanh layers of `width`, two leaves (kernel, bias) each: `leaves // 2` layers."""
    layers = max(leaves // 2, 1)
    keys = jax.random.split(key, layers + 2)
    params = {
        f"layer{i:04d}": {
            "w": jax.random.normal(keys[i], (width, width)) / np.sqrt(width),
            "b": jnp.zeros((width,)),
        }
        for i in range(layers)
    }
    x = jax.random.normal(keys[-2], (batch, width))
    y = jax.random.randint(keys[-1], (batch,), 0, width)

    def loss_fn(params, batch):
        h, labels = batch[0].astype(compute), batch[1]
        for name in sorted(params):
            layer = params[name]
            h = jnp.tanh(h @ layer["w"].astype(compute) + layer["b"].astype(compute))
        logits = h.astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return params, (x, y), loss_fn


def small_transformer(key, leaves: int):
    """`train_step.py`'s transformer at width 64, `(leaves - 2) // 6` blocks."""
    depth = max((leaves - 2) // 6, 1)
    return train_step.transformer(
        key, width=64, heads=4, depth=depth, tokens=32, rows=4, vocab=256
    )


PARTS = {"mlp": deep_mlp, "transformer": small_transformer}


def _check_only(check):
    """A step that only checks the gradients (the parameters pass through)."""

    def make(params):
        return (lambda params, state, grads: (params, check(grads))), ()

    return make


def _per_leaf(grads):
    """`optax.apply_if_finite`'s check: a reduction per leaf."""
    leaves = jax.tree.leaves(grads)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in leaves]))


# `--parts check`: the finiteness check alone, this backend's form against
# apply_if_finite's (design.md, "Checking finiteness").
CHECK_PEER = "jnp.isfinite per leaf (optax.apply_if_finite's check)"
CHECKS = {
    CHECK_PEER: _check_only(_per_leaf),
    "lossscale.all_finite": _check_only(lossscale.all_finite),
}


def measure(make, params, third, device=None) -> dict:
    """Trace and lower, then compile, the jitted step; XLA's figures of it."""
    params = jax.tree.map(jnp.copy, params)
    step, state = make(params)
    jitted = jax.jit(step, donate_argnums=(0, 1))
    args = (params, state, third)
    if device is not None:  # compiled for a device this machine need not have
        import compiled as aot

        sharding = jax.sharding.SingleDeviceSharding(device)
        args = tuple(aot._abstract(tree, sharding) for tree in args)
    start = CLOCK[0]()
    lowered = jitted.lower(*args)
    lowered_at = CLOCK[0]()
    compiled = lowered.compile()
    compiled_at = CLOCK[0]()
    text = compiled.as_text()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {
        "lower_s": lowered_at - start,
        "compile_s": compiled_at - lowered_at,
        "total_s": compiled_at - start,
        "instructions": len(_INSTRUCTION.findall(text)),
        "fusions": text.count(" fusion("),
        "bytes_accessed": float((cost or {}).get("bytes accessed", np.nan)),
    }


def run(part, names, leaves, grad_dtype, repeats, caps=None, device=None):
    """Every variant of `part` at `leaves`, each jitted afresh, `repeats` times."""
    if part in ("optimizer", "check"):
        params, third = make_trees(leaves, grad_dtype)
        variants, baseline = optimizer_step.VARIANTS, BASELINE
        if part == "check":
            variants, baseline = CHECKS, CHECK_PEER
    else:
        params, third, loss_fn = PARTS[part](jax.random.key(0), leaves)
        variants = {name: make(loss_fn) for name, make in train_step.VARIANTS.items()}
        baseline, grad_dtype = train_step.BASELINE, "float16 step"
    count = len(jax.tree.leaves(params))
    rows = []
    for name in names[part]:
        print(f"  {part}, {count} leaves: {name}", file=sys.stderr, flush=True)
        row = {"part": part, "leaves": count, "grad_dtype": str(grad_dtype)}
        row["variant"] = name
        cap = min((n for key, n in (caps or {}).items() if key in name), default=None)
        if cap is not None and leaves > cap:
            row["error"] = f"not run above {cap} leaves (--cap)"
            rows.append(row)
            continue
        try:
            results = [
                measure(variants[name], params, third, device) for _ in range(repeats)
            ]
            row.update(min(results, key=lambda r: r["total_s"]))
            row["error"] = None
        except Exception as error:  # a failing peer is reported, not dropped
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:140]}"
        rows.append(row)
    base = {r["variant"]: r for r in rows}
    peer = {"optimizer": PEER, "check": CHECK_PEER}.get(part, TRAIN_PEER)
    for row in rows:
        if row["error"]:
            continue
        for key, ref in (("adam_ratio", baseline), ("peer_ratio", peer)):
            ok = ref in base and not base[ref]["error"]
            row[key] = row["total_s"] / base[ref]["total_s"] if ok else np.nan
            if key == "adam_ratio" and ok:
                row["lower_ratio"] = row["lower_s"] / base[ref]["lower_s"]
    return rows


def slopes(rows) -> dict:
    """ms per leaf: the least-squares slope of total time against leaves."""
    out = {}
    for key in {(r["part"], r["variant"], r["grad_dtype"]) for r in rows}:
        points = [
            (r["leaves"], r["total_s"])
            for r in rows
            if (r["part"], r["variant"], r["grad_dtype"]) == key and not r["error"]
        ]
        if len(points) >= 2:
            x, y = np.array(points, dtype=float).T
            out[key] = 1e3 * float(np.polyfit(x, y, 1)[0])
    return out


def write(rows, out: str, argv, target: str) -> None:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    meta = {
        "command": " ".join(["python", "benchmarks/compile_time.py", *argv]),
        "jax": jax.__version__,
        "optax": optax.__version__,
        "lossscale": lossscale.__version__,
        "target": target,
        "host": f"{os.cpu_count()} CPUs",
    }
    fitted = slopes(rows)
    with open(out + ".json", "w") as f:
        json.dump(
            {
                "meta": meta,
                "rows": rows,
                "slopes_ms_per_leaf": {
                    " | ".join(key): slope for key, slope in fitted.items()
                },
            },
            f,
            indent=1,
        )
    lines = [
        "# Compile time at model scale",
        "",
        f"`{meta['command']}`: jax {meta['jax']}, optax {meta['optax']}, compiled"
        f" for {target} on a host of {meta['host']}, lossscale {meta['lossscale']}."
        " Optimizer step: parameter leaves of 64x16 (float32), gradients of the"
        " dtype given; train steps: the whole float16 step. One process, each"
        " function jitted afresh, the minimum over repeats; times in seconds;"
        " ratios of the total (trace, lower and compile) to the baseline's (plain"
        " Adam, or the train step without loss scaling) and to"
        " `optax.apply_if_finite`'s at the same leaf count and dtype.",
        "",
        "| part | leaves | grads | variant | trace+lower s (/ baseline) | compile s |"
        " total s | / baseline | / apply_if_finite | HLO instructions | fusions |"
        " bytes / baseline's |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    baselines = (BASELINE, train_step.BASELINE, CHECK_PEER)
    base_bytes = {
        (r["part"], r["leaves"], r["grad_dtype"]): r.get("bytes_accessed")
        for r in rows
        if r["variant"] in baselines and not r["error"]
    }
    for r in rows:
        head = f"| {r['part']} | {r['leaves']} | {r['grad_dtype']} | {r['variant']} |"
        if r["error"]:
            lines.append(f"{head} failed: {r['error']} | | | | | | | |")
            continue
        ref = base_bytes.get((r["part"], r["leaves"], r["grad_dtype"]), np.nan)
        lines.append(
            f"{head} {r['lower_s']:.2f} ({r.get('lower_ratio', np.nan):.2f}x) |"
            f" {r['compile_s']:.2f} | {r['total_s']:.2f} |"
            f" {r['adam_ratio']:.2f}x | {r['peer_ratio']:.2f}x | {r['instructions']}"
            f" | {r['fusions']} | {r['bytes_accessed'] / ref:.3f}x |"
        )
    lines += [
        "",
        "Slope of the total time against the leaf count (least squares), ms per leaf:",
        "",
        "| part | variant | grads | ms per leaf |",
        "|---|---|---|---|",
    ]
    for (part, variant, dtype), slope in sorted(fitted.items()):
        lines.append(f"| {part} | {variant} | {dtype} | {slope:.2f} |")
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", default="100,300,1000,3000")
    parser.add_argument("--grad-dtypes", default="float32,bfloat16")
    parser.add_argument(
        "--parts",
        default="optimizer",
        help="of: optimizer, mlp, transformer, check (the finiteness check alone)",
    )
    parser.add_argument(
        "--target", default="cpu", choices=["cpu", "h100", "tpu-v5e", "tpu-v5p"]
    )
    parser.add_argument("--variants", default="", help="comma-separated substrings")
    parser.add_argument(
        "--inner",
        default="adam",
        choices=sorted(optimizer_step.INNERS),
        help="the optimizer: adam, or clip+adam (`optax.clip_by_global_norm(1.0)` then"
        " Adam) for every variant and the baseline alike",
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/compile_time")
    parser.add_argument(
        "--clock",
        default="wall",
        choices=["wall", "cpu"],
        help="wall: elapsed time; cpu: the process's CPU time (steadier on a busy"
        " machine)",
    )
    parser.add_argument(
        "--cap",
        default="Flax DynamicScale=300,mpx=300",
        help="variant substring=most leaves, comma-separated: variants whose compile"
        " time grows too fast to wait for (48 s at 300 leaves, on a 2-core CPU)",
    )
    args = parser.parse_args(argv)
    optimizer_step.inner = optimizer_step.INNERS[args.inner]
    CLOCK[0] = time.perf_counter if args.clock == "wall" else time.process_time
    caps = {
        part: int(n)
        for part, n in (item.rsplit("=", 1) for item in args.cap.split(",") if item)
    }
    parts = args.parts.split(",")
    unknown = [p for p in parts if p not in ("optimizer", "check", *PARTS)]
    if unknown:
        parser.error(
            f"--parts: unknown {unknown}; known: optimizer, check, {list(PARTS)}"
        )
    device = None
    if args.target != "cpu":
        import compiled as aot

        device = aot.device_for(args.target)

    def chosen(variants, always):
        return [
            name
            for name in variants
            if name not in SKIPPED
            and (
                not args.variants
                or name in always
                or any(part in name for part in args.variants.split(","))
            )
        ]

    names = {
        "optimizer": chosen(optimizer_step.VARIANTS, (BASELINE, PEER)),
        "check": list(CHECKS),
        **{
            part: chosen(train_step.VARIANTS, (train_step.BASELINE, TRAIN_PEER))
            for part in PARTS
        },
    }
    dtypes = {
        part: args.grad_dtypes.split(",")
        if part in ("optimizer", "check")
        else ["float16"]
        for part in parts
    }
    print("warming JAX's caches at 10 leaves", file=sys.stderr)
    for part in parts:
        for grad_dtype in dtypes[part]:
            run(part, names, 10, jnp.dtype(grad_dtype), 1, device=device)
    rows = []
    for leaves in map(int, args.leaves.split(",")):
        for part in parts:
            for grad_dtype in dtypes[part]:
                rows += run(
                    part, names, leaves, jnp.dtype(grad_dtype), args.repeats, caps,
                    device,
                )  # fmt: skip
                write(rows, args.out, argv, args.target)
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
