"""The compiled step, for accelerators this machine need not have: what XLA would run.

Set-up (once per target; the accelerator wheels are not dependencies of lossscale):

    python3 -m venv ~/aot-h100 && ~/aot-h100/bin/pip install -e ".[bench,aot-h100]"
    python3 -m venv ~/aot-tpu && ~/aot-tpu/bin/pip install -e ".[bench,aot-tpu]"

Run (no GPU or TPU needed; about 10-30 minutes per target on 2 cores):

    ~/aot-h100/bin/python benchmarks/compiled.py --target h100
    ~/aot-tpu/bin/python benchmarks/compiled.py --target tpu-v5e   # or tpu-v5p
    python benchmarks/compiled.py --target cpu
        [--trees flat,transformer,convnet,scan,many] [--grad-dtypes float32,...]
        [--variants SUBSTRING,...] [--train-steps mlp,transformer|none]

Every variant of `optimizer_step.py` (plain `optax.adam`, the baseline; lossscale's
`wrap`, `apply_gradients`, `TrainState`; the peers) is compiled for one device of the
target, params and optimizer state donated, over five parameter trees (10M float32
parameters except `many`): `flat` (50 equal 1-D leaves), `transformer` (a small
transformer's 50 leaves), `convnet` (a ResNet-18's convolutions and BatchNorm scales
and biases, 62 leaves), `scan` (12 transformer layers stacked for `lax.scan`, 16
leaves) and `many` (1024 leaves of 64x16, 1M parameters: compile time); with float32,
float16 and bfloat16 gradients. Then the whole train step of `train_step.py`'s MLP
and transformer (forward, backward, update), computing in float16 and in bfloat16.
Read from the compiled program (`xla_counts.py`): kernels (H100) or vector ops (TPU)
or fusions (CPU) of an applied and a skipped step, copies, surviving conditionals,
bytes (H100 and CPU: XLA's cost analysis; TPU: an HBM estimate), temp buffers, and
the wall time of trace, lower and compile on this host. These say what the device
would run, not how long it takes. Results: `benchmarks/results/compiled_<target>.md`
and `.json`, with the versions.
"""

from __future__ import annotations

import os

os.environ["JAX_PLATFORMS"] = "cpu"  # compile-only targets need no driver or chip
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("KERAS_BACKEND", "jax")

import argparse  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optimizer_step  # noqa: E402
import train_step  # noqa: E402
import xla_counts  # noqa: E402
from h100_spec import H100_SXM  # noqa: E402

import lossscale  # noqa: E402

BASELINE = "plain optax step (baseline)"
TRAIN_BASELINE = train_step.BASELINE
# Their compile time grows much faster than linearly (compile_time.py): not at 1024.
CAPPED_AT_MANY = ("Flax DynamicScale recipe", "mpx")


# What `device_for` reports, for merging runs stored without it.
DEVICE_KINDS = {
    "h100": "NVIDIA H100 80GB HBM3",
    "tpu-v5e": "TPU v5 lite",
    "tpu-v5p": "TPU v5",
    "tpu-v6e": "TPU v6 lite",
    "cpu": "cpu",
}


def device_for(target: str):
    from jax.experimental import topologies

    if target == "cpu":
        return jax.devices("cpu")[0]
    if target == "h100":
        topology = topologies.get_topology_desc(
            platform="cuda", topology="1x1x1", target_config=H100_SXM
        )
        return topology.devices[0]
    name = {"tpu-v5e": "v5e:2x2", "tpu-v5p": "v5p:2x2x1", "tpu-v6e": "v6e:2x2"}[target]
    return topologies.get_topology_desc(name, "tpu").devices[0]


# -- parameter trees ------------------------------------------------------------------


def _transformer(d=384, blocks=4, total=10_000_000):
    block = {
        "ln1": {"scale": (d,), "bias": (d,)},
        "attn": {
            "qkv": {"kernel": (d, 3 * d), "bias": (3 * d,)},
            "out": {"kernel": (d, d), "bias": (d,)},
        },
        "ln2": {"scale": (d,), "bias": (d,)},
        "mlp": {
            "fc1": {"kernel": (d, 4 * d), "bias": (4 * d,)},
            "fc2": {"kernel": (4 * d, d), "bias": (d,)},
        },
    }
    per_block = sum(int(np.prod(s)) for s in jax.tree.leaves(block, is_leaf=_shape))
    vocab = round((total - blocks * per_block - d) / d)
    return {
        "embed": {"embedding": (vocab, d)},
        **{f"block_{i}": block for i in range(blocks)},
        "ln_f": {"scale": (d,)},
    }


def _convnet():
    shapes = {"stem": {"conv": (7, 7, 3, 64), "bn": {"scale": (64,), "bias": (64,)}}}
    width = 64
    for stage, out in enumerate([64, 128, 256, 512]):
        for unit in range(2):
            cin = width if unit == 0 else out
            block = {
                "conv1": (3, 3, cin, out),
                "bn1": {"scale": (out,), "bias": (out,)},
                "conv2": (3, 3, out, out),
                "bn2": {"scale": (out,), "bias": (out,)},
            }
            if unit == 0 and cin != out:
                block["proj"] = (1, 1, cin, out)
            shapes[f"stage{stage}_{unit}"] = block
        width = out
    shapes["head"] = {"kernel": (512, 1000), "bias": (1000,)}
    return shapes


def _scan(layers=12, d=256):
    return {
        "embed": (8192, d),
        "layers": {
            "ln1": (layers, d),
            "qkv": (layers, d, 3 * d),
            "qkv_bias": (layers, 3 * d),
            "out": (layers, d, d),
            "ln2": (layers, d),
            "fc1": (layers, d, 4 * d),
            "fc1_bias": (layers, 4 * d),
            "fc2": (layers, 4 * d, d),
        },
        "ln_f": (d,),
    }


def _shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(n, int) for n in x)


def make_params(tree: str) -> dict:
    if tree == "flat":
        return optimizer_step.make_tree(10_000_000, 50, jnp.float32)
    if tree == "many":
        return {f"p{i:04d}": jnp.zeros((64, 16), jnp.float32) for i in range(1024)}
    shapes = {"transformer": _transformer, "convnet": _convnet, "scan": _scan}[tree]()
    return jax.tree.map(lambda s: jnp.zeros(s, jnp.float32), shapes, is_leaf=_shape)


# -- compiling and reading one step ------------------------------------------------


def _abstract(tree, sharding):
    def one(x):
        x = jnp.asarray(x)
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=sharding, weak_type=x.aval.weak_type
        )

    return jax.tree.map(one, tree)


def measure(target, device, step, state, params, third) -> dict:
    """Compiles `step(params, state, third)` for `device` and reads the program."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    dump = tempfile.mkdtemp(prefix="compiled_")
    try:
        start = time.perf_counter()
        compiled = (
            jax.jit(step, donate_argnums=(0, 1))
            .lower(
                _abstract(params, sharding),
                _abstract(state, sharding),
                _abstract(third, sharding),
            )
            .compile(compiler_options={"xla_dump_to": dump})
        )
        row = {"compile_s": time.perf_counter() - start}
        text = compiled.as_text()
        row["temp_bytes"] = int(compiled.memory_analysis().temp_size_in_bytes)
        if target == "h100":
            thunks = xla_counts.gpu_thunks(dump)
            row["applied"] = xla_counts.gpu_summary(xla_counts.count_thunks(thunks, 1))
            row["skipped"] = xla_counts.gpu_summary(xla_counts.count_thunks(thunks, 0))
            row["bytes"] = xla_counts.bytes_from_cpu_analysis(compiled)
        else:
            row["applied"] = xla_counts.hlo_summary(xla_counts.count_hlo(text, True))
            row["skipped"] = xla_counts.hlo_summary(xla_counts.count_hlo(text, False))
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            row["cost_analysis_bytes"] = float(cost["bytes accessed"])
            if target.startswith("tpu"):
                row["bytes"] = xla_counts.hbm_traffic(text, applied=True)
                row["bytes_skipped"] = xla_counts.hbm_traffic(text, applied=False)
            else:
                row["bytes"] = row["cost_analysis_bytes"]
        return row
    finally:
        shutil.rmtree(dump, ignore_errors=True)


def attempt(target, device, make, params, third, fixed) -> dict:
    try:
        step, state = make(jax.tree.map(lambda x: x.copy(), params))
        return {**fixed, **measure(target, device, step, state, params, third)}
    except Exception as error:  # a failing peer is reported, not dropped
        traceback.print_exc(limit=2, file=sys.stderr)
        line = (str(error).splitlines() or [""])[0][:160]
        return {**fixed, "error": f"{type(error).__name__}: {line}"}


# -- the tables ------------------------------------------------------------------------


def _work(row: dict, which: str) -> str:
    s = row[which]
    if "kernels" in s:  # H100
        return f"{s['kernels']} ({s['copies']})"
    unfused = ", ".join(f"{n} {op}" for op, n in sorted(s["unfused"].items()))
    return f"{s['vector_ops']}" + (f" ({unfused})" if unfused else "")


def table(rows: list[dict], target: str) -> str:
    work = "kernels (copies)" if target == "h100" else "vector ops (unfused)"
    if target == "cpu":
        work = "fusions and ops (unfused)"
    byte = "HBM bytes est." if target.startswith("tpu") else "bytes accessed"
    lines = [
        f"| part | tree | grads | variant | {work}, applied | skipped | conds |"
        f" {byte} | vs baseline | vs floor | temp MB | compile s | vs baseline |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['part']} | {r['tree']} | {r['grads']} | {r['variant']} |"
        if "error" in r or "capped" in r:
            lines.append(f"{head} {r.get('error') or r['capped']} |" + " |" * 8)
            continue
        lines.append(
            f"{head} {_work(r, 'applied')} | {_work(r, 'skipped')} |"
            f" {r['applied']['conds']} | {r['bytes'] / 1e6:.1f} MB |"
            f" {r.get('vs_baseline', float('nan')):.3f}x |"
            f" {r.get('vs_floor', float('nan')):.3f}x | {r['temp_bytes'] / 1e6:.2f} |"
            f" {r['compile_s']:.1f} |"
            f" {r.get('compile_vs_baseline', float('nan')):.2f}x |"
        )
    return "\n".join(lines)


def _ratios(rows: list[dict], baseline: str, floor_extra) -> None:
    """Bytes and compile time against the baseline of the same part, tree, grads."""
    base = {
        (r["part"], r["tree"], r["grads"]): r
        for r in rows
        if r["variant"] == baseline and "bytes" in r
    }
    for r in rows:
        b = base.get((r["part"], r["tree"], r["grads"]))
        if b is None or "bytes" not in r:
            continue
        r["vs_baseline"] = r["bytes"] / b["bytes"]
        r["vs_floor"] = r["bytes"] / (b["bytes"] + floor_extra(r))
        r["compile_vs_baseline"] = r["compile_s"] / b["compile_s"]


def versions() -> dict:
    found = {"lossscale": lossscale.__version__, "jax": jax.__version__}
    for package in ("jaxlib", "libtpu", "jax-cuda12-plugin", "optax", "flax"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def _command_of(run: dict) -> str:
    # Runs stored before the command was recorded: read it back from the rows.
    def listed(part, key):
        found = dict.fromkeys(r[key] for r in run["rows"] if r["part"] == part)
        return ",".join(found) or "none"

    return (
        f"python benchmarks/compiled.py --target {run['target']}"
        f" --trees {listed('optimizer', 'tree')}"
        f" --grad-dtypes {listed('optimizer', 'grads')}"
        f" --train-steps {listed('train step', 'tree')}"
    )


def write(out, target, device_kind, found, rows, commands) -> None:
    """Stores one target's rows as `out`.md (the table) and `out`.json."""
    runs = " and ".join(f"`{c}`" for c in commands)
    heading = (
        f"# Compiled steps for {device_kind} ({target}), deviceless\n\n"
        f"{runs} ({', '.join(f'{k} {v}' for k, v in found.items())}). What XLA would"
        " run, read from the compiled program, not a timing. Baselines: plain"
        " `optax.adam` (optimizer step), the float16/bfloat16 step without loss"
        " scaling (train step). Floor: the baseline's bytes plus one read of the"
        " gradients. Compile s: trace, lower and compile on a 2-core host, shared"
        " with other work: a rough figure.\n"
    )
    text = heading + "\n" + table(rows, target) + "\n"
    with open(out + ".md", "w") as f:
        f.write(text)
    record = {
        "target": target,
        "device_kind": device_kind,
        "command": " and ".join(commands),
        "versions": found,
    }
    with open(out + ".json", "w") as f:
        json.dump({**record, "rows": rows}, f, indent=1)
    print(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--target",
        required=True,
        choices=["h100", "tpu-v5e", "tpu-v5p", "tpu-v6e", "cpu"],
    )
    parser.add_argument("--trees", default="flat,transformer,convnet,scan,many")
    parser.add_argument("--grad-dtypes", default="float32,float16,bfloat16")
    parser.add_argument("--variants", default="", help="comma-separated substrings")
    parser.add_argument("--train-steps", default="mlp,transformer")
    parser.add_argument("--compute", default="float16,bfloat16")
    parser.add_argument(
        "--out", default=None, help="default: results/compiled_<target>"
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="write one result from runs of the same target (e.g. `many` run apart)",
    )
    args = parser.parse_args(argv)
    out = args.out or os.path.join(
        os.path.dirname(__file__), "results", f"compiled_{args.target}"
    )
    if args.merge:  # no compiler needed (a TPU's may be held by another run)
        runs = [json.load(open(path)) for path in args.merge]
        if any(run["target"] != args.target for run in runs):
            raise SystemExit(f"--merge: every run must be of --target {args.target}")
        commands = [run.get("command") or _command_of(run) for run in runs]
        rows = [row for run in runs for row in run["rows"]]
        kind = runs[0].get("device_kind") or DEVICE_KINDS[args.target]
        write(out, args.target, kind, runs[0]["versions"], rows, commands)
        return 0
    device = device_for(args.target)
    chosen = [
        name
        for name in optimizer_step.VARIANTS
        if not args.variants
        or name == BASELINE
        or any(part in name for part in args.variants.split(","))
    ]
    rows = []
    for tree in args.trees.split(","):
        params = make_params(tree)
        for dtype in args.grad_dtypes.split(","):
            grads = jax.tree.map(lambda p: p.astype(dtype), params)  # noqa: B023
            for name in chosen:
                fixed = {"part": "optimizer", "tree": tree, "grads": dtype}
                fixed["variant"] = name
                if tree == "many" and any(c in name for c in CAPPED_AT_MANY):
                    rows.append({**fixed, "capped": "not run: capped (compile time)"})
                    continue
                make = optimizer_step.VARIANTS[name]
                rows.append(attempt(args.target, device, make, params, grads, fixed))
                print(f"{tree} {dtype} {name}: {rows[-1].get('error', 'ok')}",
                      file=sys.stderr, flush=True)  # fmt: skip
    for model in filter(None, args.train_steps.split(",")):
        if model == "none":
            continue
        for compute in args.compute.split(","):
            builder = train_step.MODELS[model]
            params, batch, loss_fn = builder(jax.random.key(0), compute=compute)
            for name, make in train_step.VARIANTS.items():
                if (
                    args.variants
                    and name != TRAIN_BASELINE
                    and not any(part in name for part in args.variants.split(","))
                ):
                    continue
                fixed = {"part": "train step", "tree": model, "grads": compute}
                fixed["variant"] = name
                if name == TRAIN_BASELINE:  # the same step, in the run's dtype
                    fixed["variant"] = name.replace("float16", compute)
                rows.append(
                    attempt(args.target, device, make(loss_fn), params, batch, fixed)
                )
                print(f"{model} {compute} {name}: {rows[-1].get('error', 'ok')}",
                      file=sys.stderr, flush=True)  # fmt: skip
    params_bytes = {}

    def floor_extra(row):
        # One read of the gradients: their dtype in the optimizer step; the train
        # step's gradients are of the float32 parameters.
        key = (row["part"], row["tree"], row["grads"])
        if key not in params_bytes:
            if row["part"] == "optimizer":
                count = sum(x.size for x in jax.tree.leaves(make_params(row["tree"])))
                params_bytes[key] = count * jnp.dtype(row["grads"]).itemsize
            else:
                built = train_step.MODELS[row["tree"]](jax.random.key(0))[0]
                params_bytes[key] = sum(x.size * 4 for x in jax.tree.leaves(built))
        return params_bytes[key]

    _ratios([r for r in rows if r["part"] == "optimizer"], BASELINE, floor_extra)
    train = [r for r in rows if r["part"] != "optimizer"]
    for compute in args.compute.split(","):
        baseline = TRAIN_BASELINE.replace("float16", compute)
        _ratios([r for r in train if r["grads"] == compute], baseline, floor_extra)
    command = (
        f"python benchmarks/compiled.py --target {args.target}"
        f" --trees {args.trees} --grad-dtypes {args.grad_dtypes}"
        f" --train-steps {args.train_steps}"
    )
    write(out, args.target, device.device_kind, versions(), rows, [command])
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
