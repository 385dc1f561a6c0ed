"""XLA:CPU's check of large 16-bit leaves: 0.3.0's `max`/`min` against today's form.

    python benchmarks/narrow_check.py [--sizes 1M,10M,50M] [--rounds 7]

0.3.0 checked a large float16 or bfloat16 leaf with `isfinite(max(x)) &
isfinite(min(x))`, which misses a NaN in one shard under sharded `jax.jit` (the
devices' maxima are combined by an all-reduce that drops it). Today's form
(`forms.narrow_probes`) uses a sum (bfloat16) or an `or` (float16). This times the
one-call step, `lossscale.apply_gradients` with Adam over 50 leaves of float32
parameters and 16-bit gradients, in both forms and plain Adam, interleaved in one
process (median over rounds; the ratios come from one run), with XLA's bytes and
temp of each compiled step. Results: a table on stdout and
`benchmarks/results/narrow_check_cpu.md` (`--out`).
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import lossscale
from lossscale._src.step import forms


def max_and_min(values):
    """0.3.0's probes of large 16-bit leaves: two plain reductions each."""
    top = forms._wide(forms._stack([lax.reduce_max(v, forms._axes(v)) for v in values]))
    low = forms._wide(forms._stack([lax.reduce_min(v, forms._axes(v)) for v in values]))
    return lax.add(lax.sub(top, top), lax.sub(low, low))


VARIANTS = {"plain adam": None, "0.3.0: max and min": max_and_min}
VARIANTS["today: sum or any"] = forms.narrow_probes


def parse_size(text):
    units = {"K": 10**3, "M": 10**6}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def compiled_step(variant, params, grads):
    tx = optax.adam(1e-3)
    if variant is None:

        def step(params, opt_state, loss_scale, grads):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss_scale

    else:

        def step(params, opt_state, loss_scale, grads):
            return lossscale.apply_gradients(
                tx,
                grads=grads,
                params=params,
                opt_state=opt_state,
                loss_scale=loss_scale,
            )

    shipped = forms.narrow_probes
    forms.narrow_probes = variant or shipped  # read while tracing, below
    try:
        state = [params, tx.init(params), lossscale.DynamicLossScale()]
        jitted = jax.jit(step, donate_argnums=(0, 1, 2))
        compiled = jitted.lower(*state, grads).compile()
    finally:
        forms.narrow_probes = shipped
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    figures = {
        "bytes": float(cost["bytes accessed"]),
        "temp": int(compiled.memory_analysis().temp_size_in_bytes),
    }
    return compiled, [jax.tree.map(jnp.copy, s) for s in state], figures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,10M,50M")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/narrow_check_cpu")
    args = parser.parse_args(argv)
    lines = [
        "# XLA:CPU's check of large 16-bit leaves, in the one-call Adam step",
        "",
        f"`python benchmarks/narrow_check.py --sizes {args.sizes} --rounds"
        f" {args.rounds}`: jax {jax.__version__}, {jax.default_backend()},"
        f" {os.cpu_count()} CPUs. 50 leaves of float32 parameters; time is the"
        f" median over {args.rounds} interleaved rounds, as a ratio to plain Adam's"
        " in the same run.",
        "",
        "| parameters | gradients | variant | time / Adam | bytes / Adam | temp MB |",
        "|---|---|---|---|---|---|",
    ]
    for size in args.sizes.split(","):
        total = parse_size(size)
        for dtype in (jnp.float16, jnp.bfloat16):
            params = {
                f"p{i}": jnp.full((total // 50,), 0.1, jnp.float32) for i in range(50)
            }
            grads = jax.tree.map(lambda p, d=dtype: (p * 1e-3).astype(d), params)
            built = {n: compiled_step(v, params, grads) for n, v in VARIANTS.items()}
            times = {name: [] for name in built}
            steps = max(2, int(3e8 // total))
            for _ in range(args.rounds):
                for name, (compiled, state, _) in built.items():
                    state[:] = compiled(*state, grads)
                    jax.block_until_ready(state)
                    start = time.perf_counter()
                    for _ in range(steps):
                        state[:] = compiled(*state, grads)
                    jax.block_until_ready(state)
                    times[name].append((time.perf_counter() - start) / steps)
            base_time = np.median(times["plain adam"])
            base_bytes = built["plain adam"][2]["bytes"]
            for name, (_, _, figures) in built.items():
                lines.append(
                    f"| {size} | {jnp.dtype(dtype).name} | {name} |"
                    f" {np.median(times[name]) / base_time:.3f}x |"
                    f" {figures['bytes'] / base_bytes:.3f}x |"
                    f" {figures['temp'] / 1e6:.1f} |"
                )
            print(lines[-1], flush=True)
    table = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
