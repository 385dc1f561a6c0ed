"""Shared by the benchmark scripts: compile, measure, compare, write the tables."""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback

import jax
import numpy as np
import optax
import profiling

import lossscale

# Opcodes that move data between host and device, and callback custom calls.
_HOST_OPS = re.compile(r"=\s*\S+\s+(send|recv|infeed|outfeed)(-done)?\(")
_CALLBACK = re.compile(r'custom_call_target="[^"]*(callback|host)[^"]*"', re.I)


def parse_size(text: str) -> int:
    """'1M' -> 1_000_000, '500k' -> 500_000, '25000' -> 25_000."""
    text = text.strip().upper()
    factor = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text[:-1] if factor > 1 else text) * factor)


def progress(label: str, done: int, total: int) -> None:
    width = 24
    filled = int(width * done / max(total, 1))
    end = "\n" if done == total else ""
    print(
        f"\r  {label[:60]:60s} [{'#' * filled}{'-' * (width - filled)}] {done}/{total}",
        end=end,
        file=sys.stderr,
        flush=True,
    )


class Candidate:
    """One variant: its jitted step, its state, and its compiled figures."""

    def __init__(self, name, make, params, grads):
        self.name = name
        self.error = None
        try:
            params = jax.tree.map(lambda x: x.copy(), params)
            step, state = make(params)
            self.jitted = jax.jit(step, donate_argnums=(0, 1))
            start = time.perf_counter()
            compiled = self.jitted.lower(params, state, grads).compile()
            self.compile_s = time.perf_counter() - start
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            memory = compiled.memory_analysis()
            text = compiled.as_text()
            self.figures = {
                "bytes_accessed": float(cost.get("bytes accessed", np.nan)),
                "flops": float(cost.get("flops", np.nan)),
                "temp_bytes": int(memory.temp_size_in_bytes),
                "argument_bytes": int(memory.argument_size_in_bytes),
                "output_bytes": int(memory.output_size_in_bytes),
                "host_transfer": bool(_HOST_OPS.search(text) or _CALLBACK.search(text)),
            }
            self.params, self.state, self.grads = params, state, grads
            self.times = []
            self.run_step()  # warm-up, and proof that it runs
        except Exception as error:  # a failing peer is reported, not dropped
            self.error = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
            traceback.print_exc(limit=1, file=sys.stderr)

    def run_step(self, block: int = 1):
        """Seconds per step over `block` steps dispatched back to back."""
        start = time.perf_counter()
        for _ in range(block):
            self.params, self.state = self.jitted(self.params, self.state, self.grads)
        jax.block_until_ready((self.params, self.state))
        return (time.perf_counter() - start) / block

    def profile(self, steps: int) -> dict[str, float]:
        """Host dispatch and device time per step, from a profiler trace."""
        return profiling.profile(self.run_step, steps)


def _profiled(candidate, base, steps: int, blocks: int = 3):
    """Profiled blocks of the candidate and the baseline, interleaved: each's
    last trace, with the median and minimum device time per step over blocks."""
    traces = {id(candidate): [], id(base): []}
    for _ in range(blocks):
        for who in (candidate, base):
            traces[id(who)].append(who.profile(steps))
    for who in (candidate, base):
        device = [t["kernel_us_per_step"] for t in traces[id(who)]]
        who.trace = {
            **traces[id(who)][-1],
            "kernel_us_per_step": float(np.median(device)),
            "kernel_us_per_step_min": float(np.min(device)),
        }


def block_size() -> int:
    """Steps per timed block: 1 on CPU; 10 on accelerators, where waiting for
    every step would time the host's round trip rather than the step."""
    return 1 if jax.default_backend() == "cpu" else 10


def profiled_steps() -> int:
    """Steps per profiled block: enough to average kernels over on a device."""
    return 5 if jax.default_backend() == "cpu" else 20


def compare(variants, params, grads, *, steps, label, baseline):
    """Builds every variant, times each interleaved with the baseline.

    Each round times one block of the baseline, then one of the variant, so slow
    drifts of the machine hit both alike; the ratios are of medians (and of
    minima) over the rounds. Then one profiled block of each gives host dispatch
    and device time per step (see `profiling.py`).
    """
    print(f"\n{label}", file=sys.stderr)
    base = Candidate(baseline, variants[baseline], params, grads)
    if base.error:
        raise RuntimeError(f"the baseline failed: {base.error}")
    rows = []
    names = [name for name in variants if name != baseline]
    for index, name in enumerate(names):
        progress(label, index, len(names))
        candidate = Candidate(name, variants[name], params, grads)
        base_times, times, compilations = [], [], None
        if not candidate.error:
            try:
                for _ in range(steps):
                    base_times.append(base.run_step(block_size()))
                    times.append(candidate.run_step(block_size()))
                compilations = candidate.jitted._cache_size()
                _profiled(candidate, base, profiled_steps())
            except Exception as error:
                candidate.error = f"{type(error).__name__}: {error}"[:160]
        rows.append(_row(label, candidate, base, base_times, times, compilations))
        del candidate
    progress(label, len(names), len(names))
    return rows


def _row(label, candidate, base, base_times, times, compilations):
    row = {"setting": label, "variant": candidate.name, "error": candidate.error}
    if candidate.error:
        return row
    figures, base_figures = candidate.figures, base.figures
    row.update(figures)
    row.update(
        {
            "median_ms": 1e3 * float(np.median(times)),
            "min_ms": 1e3 * float(np.min(times)),
            "baseline_median_ms": 1e3 * float(np.median(base_times)),
            "time_ratio": float(np.median(times) / np.median(base_times)),
            "min_time_ratio": float(np.min(times) / np.min(base_times)),
            "bytes_ratio": figures["bytes_accessed"] / base_figures["bytes_accessed"],
            "baseline_temp_bytes": base_figures["temp_bytes"],
            "compilations": compilations,
            **candidate.trace,
            **{f"baseline_{key}": value for key, value in base.trace.items()},
            "device_time_ratio": candidate.trace["kernel_us_per_step"]
            / base.trace["kernel_us_per_step"],
            "device_time_min_ratio": candidate.trace["kernel_us_per_step_min"]
            / base.trace["kernel_us_per_step_min"],
            "compile_s": candidate.compile_s,
            "baseline_compile_s": base.compile_s,
        }
    )
    return row


def write(rows, out: str, *, title: str, echo: bool = True) -> None:
    """Writes the Markdown table and the JSON next to `out`; prints it if `echo`.

    Scripts write after each setting too (`echo=False`), so a run cut short
    keeps what it measured.
    """
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    meta = {
        "command": " ".join(["python", *sys.argv]),
        "jax": jax.__version__,
        "jaxlib": jax.lib.__version__,
        "optax": optax.__version__,
        "lossscale": lossscale.__version__,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "cpu_count": os.cpu_count(),
        "steps_per_timed_block": block_size(),
        "steps_per_profiled_block": profiled_steps(),
    }
    with open(out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [
        f"# {title}",
        "",
        f"`{meta['command']}`: jax {meta['jax']}, {meta['backend']}"
        f" ({meta['device']}, {meta['cpu_count']} CPUs), lossscale"
        f" {meta['lossscale']}. Ratios to the baseline measured in the same run;"
        f" time per step over blocks of {meta['steps_per_timed_block']} step(s)."
        " Device time and kernels per step, and host dispatch per call, from a"
        f" profiler trace of {meta['steps_per_profiled_block']} steps (on XLA:CPU"
        ' the "kernels" are the thunks on its thread pool), median and minimum of'
        " 3 traced blocks interleaved with the baseline's; compile: `lower` +"
        " `compile` of the step, seconds (the baseline's).",
        "",
        "| setting | variant | bytes | temp MB | time (median) | time (min) |"
        " device time (median) | device time (min) | device us/step (base) |"
        " kernels/step (base) | dispatch us (base) | compile s (base) | compiles |"
        " host transfer |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row["error"]:
            lines.append(
                f"| {row['setting']} | {row['variant']} | failed: {row['error']}"
                " | | | | | | | | | | | |"
            )
            continue
        lines.append(
            f"| {row['setting']} | {row['variant']} | {row['bytes_ratio']:.3f}x |"
            f" {row['temp_bytes'] / 1e6:.1f} | {row['time_ratio']:.2f}x |"
            f" {row['min_time_ratio']:.2f}x | {row['device_time_ratio']:.2f}x |"
            f" {row['device_time_min_ratio']:.2f}x |"
            f" {row['kernel_us_per_step']:.0f}"
            f" ({row['baseline_kernel_us_per_step']:.0f}) |"
            f" {row['kernels_per_step']:.0f} ({row['baseline_kernels_per_step']:.0f})"
            f" | {_us(row['dispatch_us'])} ({_us(row['baseline_dispatch_us'])}) |"
            f" {row['compile_s']:.2f} ({row['baseline_compile_s']:.2f}) |"
            f" {row['compilations']} | {'yes' if row['host_transfer'] else 'no'} |"
        )
    table = "\n".join(lines) + "\n"
    with open(out + ".md", "w") as f:
        f.write(table)
    if echo:
        print("\n" + table)
        print(f"written: {out}.json, {out}.md")


def _us(value: float) -> str:
    return "n/a" if np.isnan(value) else f"{value:.0f}"
