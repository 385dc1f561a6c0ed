"""Where compile time goes: trace, lower and XLA's compile, per variant and per leaf.

    python benchmarks/compile_phases.py [--leaves 1000] [--part optimizer]
    python benchmarks/compile_phases.py --leaves 40 --passes   # XLA's passes too

For plain Adam (or the train step without loss scaling), `apply_gradients`, `wrap`
and `TrainState` on the trees of `compile_time.py`: the CPU time (this process's,
less sensitive to a loaded machine than wall time) of tracing to a jaxpr, lowering to
StableHLO and XLA:CPU's compile, the minimum over `--repeats`; the equations traced
(sub-jaxprs included), HLO instructions before and after XLA's optimisation, and the
fusions; per leaf. With `--passes`, each variant is compiled again in a child process
that logs XLA's pass pipeline (`TF_CPP_VMODULE=hlo_pass_pipeline=1`), and the slowest
passes are listed: what is not in them is LLVM's code generation.
Results: a table on stdout and `--out` (.md), default
`benchmarks/results/compile_phases_cpu.md`.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import time

import compile_time  # noqa: E402
import jax
import jax.numpy as jnp
import optimizer_step  # noqa: E402
import train_step  # noqa: E402

NAMES = {
    "optimizer": {
        "Adam": compile_time.BASELINE,
        "apply_gradients": "lossscale.apply_gradients (one call), dynamic",
        "wrap": "lossscale.wrap(tx), dynamic",
        "TrainState": "lossscale.flax.TrainState (whole step), dynamic",
    },
    "train": {
        "Adam": train_step.BASELINE,
        "apply_gradients": "lossscale.apply_gradients, dynamic",
        "wrap": "lossscale.wrap(adam), dynamic",
        "TrainState": "lossscale.flax.TrainState, dynamic",
    },
}
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%?[\w.\-]+ = ", re.M)
_PASS = re.compile(r"HLO pass: (\S+) time: ([\d.]+) (us|ms|s|min) ")
_UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0}


def build(part: str, leaves: int, short: str):
    """`(step, state, params, third)` of one variant, built afresh."""
    if part == "optimizer":
        params, third = compile_time.make_trees(leaves, jnp.float32)
        make = optimizer_step.VARIANTS[NAMES["optimizer"][short]]
    else:
        params, third, loss_fn = compile_time.PARTS[part](jax.random.key(0), leaves)
        make = train_step.VARIANTS[NAMES["train"][short]](loss_fn)
    params = jax.tree.map(jnp.copy, params)
    step, state = make(params)
    return step, state, params, third


def equations(jaxpr) -> int:
    return sum(
        1 + sum(equations(sub) for sub in jax.extend.core.jaxprs_in_params(e.params))
        for e in jaxpr.eqns
    )


def measure(part: str, leaves: int, short: str) -> dict:
    step, state, params, third = build(part, leaves, short)
    jitted = jax.jit(step, donate_argnums=(0, 1))
    start = time.process_time()
    traced = jitted.trace(params, state, third)
    traced_at = time.process_time()
    lowered = traced.lower()
    lowered_at = time.process_time()
    compiled = lowered.compile()
    compiled_at = time.process_time()
    text = compiled.as_text()
    return {
        "trace_s": traced_at - start,
        "lower_s": lowered_at - traced_at,
        "compile_s": compiled_at - lowered_at,
        "equations": equations(traced.jaxpr.jaxpr),
        "hlo_before": len(_INSTRUCTION.findall(lowered.as_text(dialect="hlo"))),
        "hlo_after": len(_INSTRUCTION.findall(text)),
        "fusions": text.count(" fusion("),
        "leaves": len(jax.tree.leaves(params)),
    }


def passes(part: str, leaves: int, short: str, top: int) -> list[tuple[str, float]]:
    """XLA's slowest passes on the step's module, from a child process's log."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0")
    env["TF_CPP_VMODULE"] = "hlo_pass_pipeline=1"
    child = [sys.executable, __file__, "--child", part, str(leaves), short]
    log = subprocess.run(child, env=env, capture_output=True, text=True).stderr
    times, module = collections.Counter(), None
    for line in log.splitlines():
        found = re.search(r"on module (\S+):", line)
        if found:
            module = found.group(1)
            continue
        found = _PASS.search(line)
        if found and module and module.startswith("jit_step"):
            times[found.group(1)] += float(found.group(2)) * _UNIT[found.group(3)]
    return times.most_common(top)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, default=1000)
    parts = ["optimizer", *compile_time.PARTS]
    parser.add_argument("--part", default="optimizer", choices=parts)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--passes", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/compile_phases_cpu")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # compile once, for the parent's pass log
        part, leaves, short = args.child
        step, state, params, third = build(part, int(leaves), short)
        jax.jit(step, donate_argnums=(0, 1)).lower(params, state, third).compile()
        return
    for short in NAMES["optimizer"]:  # JAX's own caches warm for every variant
        measure(args.part, 10, short)
    rows = {}
    for _ in range(args.repeats):
        for short in NAMES["optimizer"]:
            row = measure(args.part, args.leaves, short)
            total = row["trace_s"] + row["lower_s"] + row["compile_s"]
            if short not in rows or total < rows[short]["total_s"]:
                rows[short] = {**row, "total_s": total}
    base = rows["Adam"]
    n = base["leaves"]
    lines = [
        f"# Where compile time goes: {args.part}, {n} leaves",
        "",
        f"`python benchmarks/compile_phases.py {' '.join(argv or sys.argv[1:])}`:"
        f" jax {jax.__version__}, XLA:CPU, {os.cpu_count()} CPUs. CPU seconds of"
        f" this process, the minimum of {args.repeats}; in brackets, the ratio to"
        " the baseline's (plain Adam, or the step without loss scaling).",
        "",
        "| variant | trace s | lower s | compile s | total s | equations traced |"
        " HLO before / after optimisation | fusions | ms per leaf (total) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for short, r in rows.items():
        phases = ("trace_s", "lower_s", "compile_s", "total_s")
        ratio = {k: r[k] / base[k] for k in phases}
        lines.append(
            f"| {short} | {r['trace_s']:.2f} ({ratio['trace_s']:.2f}x) |"
            f" {r['lower_s']:.2f} ({ratio['lower_s']:.2f}x) |"
            f" {r['compile_s']:.2f} ({ratio['compile_s']:.2f}x) |"
            f" {r['total_s']:.2f} ({ratio['total_s']:.2f}x) | {r['equations']} |"
            f" {r['hlo_before']} / {r['hlo_after']} | {r['fusions']} |"
            f" {1e3 * r['total_s'] / n:.1f} |"
        )
    if args.passes:
        lines += [
            "",
            "XLA's slowest passes (seconds, one compile in a child process):",
            "",
        ]
        for short in ("Adam", "apply_gradients"):
            found = passes(args.part, args.leaves, short, 6)
            listed = ", ".join(f"{name} {seconds:.2f}" for name, seconds in found)
            lines.append(
                f"- {short}: {listed or 'no pass log (XLA did not print one)'}"
            )
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
