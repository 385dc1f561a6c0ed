"""Host cost per call of a train step's arguments: flattening, buffers, outputs.

    python benchmarks/dispatch.py [--size 1M] [--leaves 50] [--rounds 25]

A jitted step pays, on the host, for every array it takes and returns, whatever it
computes. To see what the loss-scale state adds, each state below goes through a
jitted function that returns its arguments as they are (donated, so nothing is
copied): the time per call is pure host overhead. The rows are interleaved over
rounds; the table gives the median and the 25th percentile per call.
Results: `benchmarks/results/dispatch_<backend>.md` (`--out`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import report  # noqa: E402

import lossscale  # noqa: E402


def states(params):
    adam = optax.adam(1e-3)
    dynamic = lossscale.DynamicLossScale()
    leaves = jax.tree.leaves(dynamic)
    int32 = [x.astype(jnp.int32) for x in leaves if x.dtype != jnp.float32]
    return {
        "optax.adam state (baseline)": adam.init(params),
        "adam state + DynamicLossScale (7 named leaves)": (adam.init(params), dynamic),
        "adam state + the same 7 leaves in a tuple": (adam.init(params), tuple(leaves)),
        "adam state + 3 rule leaves, the 4 counters in one array": (
            adam.init(params),
            (*leaves[:3], jnp.stack(int32[-4:])),
        ),
        "adam state + 2 arrays packed by dtype (0.2's layout)": (
            adam.init(params),
            (jnp.stack(int32), dynamic.scale[None]),
        ),
        "lossscale.wrap(adam) state": lossscale.wrap(adam).init(params),
        "adam state + Keras-like (scale, counter) scalars": (
            adam.init(params),
            (jnp.float32(2.0**15), jnp.zeros([], jnp.int32)),
        ),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1M")
    parser.add_argument("--leaves", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    out = args.out or f"benchmarks/results/dispatch_{jax.default_backend()}"
    total = report.parse_size(args.size)
    params = {
        f"p{i:02d}": jnp.zeros((total // args.leaves,), jnp.float32)
        for i in range(args.leaves)
    }
    grads = jax.tree.map(jnp.copy, params)
    identity = jax.jit(lambda p, s, g: (p, s), donate_argnums=(0, 1))
    carries = {
        name: identity(*jax.tree.map(jnp.copy, (params, state)), grads)
        for name, state in states(params).items()
    }
    times = {name: [] for name in carries}
    for _ in range(args.rounds):
        for name, (p, s) in carries.items():
            jax.block_until_ready((p, s))
            start = time.perf_counter()
            for _ in range(args.calls):
                p, s = identity(p, s, grads)
            jax.block_until_ready((p, s))
            times[name].append((time.perf_counter() - start) / args.calls)
            carries[name] = (p, s)
    base = np.median(times["optax.adam state (baseline)"])
    lines = [
        "# Host cost per call of a step's arguments",
        "",
        f"`python {' '.join(sys.argv)}`: jax {jax.__version__},"
        f" {jax.default_backend()} ({jax.devices()[0].device_kind},"
        f" {os.cpu_count()} CPUs); {args.size} float32 parameters in"
        f" {args.leaves} leaves, plus their gradients; a jitted identity with"
        f" donated buffers, {args.calls} calls per round, {args.rounds} rounds.",
        "",
        "| arguments | leaves | median us/call | p25 us/call | median - baseline |",
        "|---|---|---|---|---|",
    ]
    for name, samples in times.items():
        leaves = len(jax.tree.leaves((params, carries[name][1], grads)))
        median = np.median(samples)
        lines.append(
            f"| {name} | {leaves} | {1e6 * median:.1f} |"
            f" {1e6 * np.percentile(samples, 25):.1f} | {1e6 * (median - base):+.1f} |"
        )
    table = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".md", "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
