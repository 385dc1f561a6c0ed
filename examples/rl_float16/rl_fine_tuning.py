"""Float16 for RL fine-tuning: the training-inference mismatch, RL runs, underflow.

    python examples/rl_float16/rl_fine_tuning.py   # the full run (its .md: the time)
    python examples/rl_float16/rl_fine_tuning.py --pretrain-steps 20 --seeds 0 \
        --steps 5 --quick --out /tmp/rl_smoke   # a smoke run, no plot (5 min: compiles)

Uses `examples/rl_float16/rl_float16.py` (the byte-level language model of
`lossscale/demo_language_model.py`, its KV-cached sampler, the lipogram task and the
clipped GRPO step with lossscale). In one process:

1. Pretrains the model in float32 (`--pretrain-steps` of 64 x 128 bytes of
   `pydoc_data.topics`).
2. The mismatch: from the same float32 parameters (at initialisation and
   pretrained), the sampler (prefill + token-by-token decode with a KV cache)
   and the trainer (the full-sequence forward) in float32, bfloat16 and float16,
   on 64 held-out prompts of 16 bytes and continuations of each of
   `--lengths` bytes: `rl_float16.mismatch`'s figures.
3. `lossscale.diagnostics.preflight` of the RL loss on the first batch, per
   precision, and of the same loss divided by a 10,000 times larger token count.
4. RL fine-tuning over `--seeds` in float32, bfloat16, float16 with lossscale
   (a dynamic scale) and float16 without: reward, mismatch, loss scale and
   skipped steps per step; every `--underflow-every` steps, the share of gradient
   elements that are non-zero in a float32 reference gradient (same parameters,
   same batch, float32 compute) and exactly zero in the run's gradient (its
   precision and loss scale, unscaled in float32).
5. The sweep: that share against the number of tokens the loss averages over,
   at the pretrained parameters on one batch: the loss divided by the batch's
   token count times 1, 10, ..., 1e5 (as a micro-batch of a larger batch is
   divided by the larger batch's count), float16 unscaled and at 2**15, and
   bfloat16 unscaled.

Results: `benchmarks/results/rl_fine_tuning.{json,md,png}` (`--out`), with the
command, versions, machine, wall and CPU time. `--short-seeds 0,1,2,3,4 --out
benchmarks/results/rl_fine_tuning_short` runs the slow test's short version over
seeds, from which its margins come.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import platform
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import rl_float16 as rl  # noqa: E402

import lossscale

F32, BF16, F16 = rl.F32, rl.BF16, rl.F16
DTYPES = {"float32": F32, "bfloat16": BF16, "float16": F16}


def cpu_seconds() -> float:
    """The process's CPU time so far, user and system, in seconds."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def log(message: str, start: float, stages: list) -> None:
    """Prints the wall and CPU time so far, and appends them to `stages`."""
    wall, cpu = time.perf_counter() - start, cpu_seconds()
    stages.append({"stage": message, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1)})
    print(f"[{wall:5.0f} s wall, {cpu:5.0f} s CPU] {message}", file=sys.stderr)


# 2. The mismatch.


@functools.cache
def _trainer_fn(compute, width, layers):
    model = rl.language_model.ByteLM(width=width, layers=layers, compute=compute)
    return jax.jit(
        functools.partial(rl.trainer_log_probs, model),
        static_argnames="prompt_length",
        compiler_options=rl.STRICT_ROUNDING,
    )


def measure_mismatch(
    params, prompts, lengths, seed=0, dtypes=tuple(DTYPES), attention="kernel"
):
    """`rl.mismatch` per compute dtype and continuation length, from `params`."""
    out = {}
    prompt_length = prompts.shape[1]
    for name in dtypes:
        compute = DTYPES[name]
        trainer = _trainer_fn(compute, *rl.shape_of(params))
        for length in lengths:
            generated, sampler_lp = rl.sample(
                params,
                prompts,
                jax.random.key(seed),
                new_tokens=length,
                compute=compute,
                attention=attention,
            )
            tokens = jnp.concatenate([prompts, generated], axis=1)
            trainer_lp = trainer(params, tokens, prompt_length=prompt_length)
            figures = rl.mismatch(sampler_lp, trainer_lp, generated)
            out.setdefault(name, {})[length] = {k: v.item() for k, v in figures.items()}
    return out


# 4 and 5. Gradients lost to underflow.


@functools.cache
def _gradient_fn(compute, prompt_length, width, layers):
    """Jitted: the unscaled float32 gradients of the RL loss, computing in `compute`.

    `tokens_averaged` is an argument (a float32 scalar), so the sweep compiles
    once per dtype and kind of loss scale.
    """
    model = rl.language_model.ByteLM(width=width, layers=layers, compute=compute)

    def gradients(params, loss_scale, tokens, sampler_lp, advantages, tokens_averaged):
        loss_fn = functools.partial(
            rl.rl_loss,
            model=model,
            prompt_length=prompt_length,
            tokens_averaged=tokens_averaged,
        )
        _, grads = lossscale.value_and_grad(loss_fn, has_aux=True)(
            loss_scale, params, tokens, sampler_lp, advantages
        )
        return lossscale.unscale_grads(grads, loss_scale)

    return jax.jit(gradients, compiler_options=rl.STRICT_ROUNDING)


@jax.jit
def _count_lost(reference, grads):
    """Per leaf, elements lost and non-zero in `reference`; whether `grads` is finite.

    Lost: non-zero in `reference`, zero in `grads`.
    """
    lost, nonzero, finite = [], [], []
    for ref, low in zip(
        jax.tree.leaves(reference), jax.tree.leaves(grads), strict=True
    ):
        lost.append(jnp.sum((ref != 0) & (low == 0)))
        nonzero.append(jnp.sum(ref != 0))
        finite.append(jnp.all(jnp.isfinite(low)))
    return jnp.stack(lost), jnp.stack(nonzero), jnp.all(jnp.stack(finite))


def lost_to_underflow(params, batch, compute, loss_scale, prompt_length, tokens):
    """The run's gradient against float32's, as device arrays.

    Lost per leaf, non-zero per leaf, and whether all are finite.

    Both gradients are of the same loss at the same parameters on the same batch;
    the reference computes in float32 without scaling, the run's in `compute`
    with `loss_scale`, unscaled in float32 before they are compared.
    """
    tokens_averaged = jnp.float32(tokens)
    args = (*batch[:3], tokens_averaged)
    shape = (prompt_length, *rl.shape_of(params))
    reference = _gradient_fn(F32, *shape)(params, lossscale.NoOpLossScale(), *args)
    grads = _gradient_fn(compute, *shape)(params, loss_scale, *args)
    return _count_lost(reference, grads)


def lost_figures(params, lost, nonzero, finite) -> dict:
    """On the host: the share lost, the counts, and the leaves that lost any."""
    names = [jax.tree_util.keystr(path) for path, _ in leaves_with_path(params)]
    lost, nonzero = np.asarray(lost), np.asarray(nonzero)
    return {
        "share": float(lost.sum() / nonzero.sum()),
        "lost": int(lost.sum()),
        "nonzero": int(nonzero.sum()),
        "finite": bool(finite),
        "by_leaf": {n: int(c) for n, c in zip(names, lost, strict=True) if c},
    }


def leaves_with_path(tree):
    """A tree's leaves with their paths, in `jax.tree` order."""
    return jax.tree_util.tree_leaves_with_path(tree)


def sweep(params, batch, prompt_length, factors):
    """The lost share against the tokens averaged over: f16, f16 at 2**15, bf16."""
    count = batch[1].shape[0] * batch[1].shape[1]
    settings = {
        "float16, unscaled": (F16, lossscale.NoOpLossScale()),
        "float16, scale 2**15": (F16, lossscale.StaticLossScale(2.0**15)),
        "bfloat16, unscaled": (BF16, lossscale.NoOpLossScale()),
    }
    out = {"tokens": [count * factor for factor in factors]}
    for name, (compute, loss_scale) in settings.items():
        out[name] = [
            lost_figures(
                params,
                *lost_to_underflow(
                    params, batch, compute, loss_scale, prompt_length, count * factor
                ),
            )
            for factor in factors
        ]
    return out


# 3. preflight.


def preflight_summary(report) -> dict:
    """What `preflight` found: codes, its scale, the findings' text."""
    return {
        "codes": sorted(report.codes),
        "scale": report.scale,
        "findings": [
            {"code": f.code, "severity": f.severity, "message": f.message}
            for f in report.findings
        ],
        "text": str(report),
    }


def preflight_at_scale(params, batch, args, factor):
    """`preflight` of the float16 loss divided by `factor` times more tokens."""
    compute, _ = rl.PRECISIONS["float16 + lossscale"]
    prompt_length = args.prompt_length
    run = rl.program(compute, args.learning_rate, prompt_length, *rl.shape_of(params))
    count = batch[1].shape[0] * batch[1].shape[1]
    loss_fn = functools.partial(
        rl.rl_loss,
        model=run.model,
        prompt_length=prompt_length,
        tokens_averaged=count * factor,
    )
    out = {}
    for name, loss_scale in [
        ("no loss scaling", lossscale.NoOpLossScale()),
        ("dynamic", lossscale.DynamicLossScale()),
    ]:
        report = lossscale.diagnostics.preflight(
            loss_fn,
            params,
            *batch[:3],
            optimizer=run.tx,
            loss_scale=loss_scale,
            has_aux=True,
        )
        out[name] = preflight_summary(report)
    return out


# 4. The RL runs.


def rl_runs(params, args, start, stages):
    """Every precision over every seed; the per-step record and underflow."""
    runs, preflights = {}, {}
    for precision in args.precisions:
        compute, _ = rl.PRECISIONS[precision]
        for index, seed in enumerate(args.seeds):
            measured = []

            def on_step(step, params, batch, loss_scale, compute=compute, out=measured):
                if step % args.underflow_every == 0 or step == args.steps - 1:
                    count = batch[1].shape[0] * batch[1].shape[1]
                    figures = lost_to_underflow(
                        params, batch, compute, loss_scale, args.prompt_length, count
                    )
                    out.append((step, *figures))

            run = rl.fine_tune(
                params,
                precision,
                steps=args.steps,
                seed=seed,
                prompt_length=args.prompt_length,
                new_tokens=args.new_tokens,
                learning_rate=args.learning_rate,
                run_preflight=index == 0,
                on_step=on_step,
            )
            run.pop("params")
            report = run.pop("preflight")
            if report is not None:
                preflights[precision] = preflight_summary(report)
            run["underflow"] = [
                {"step": step, **lost_figures(params, *figures)}
                for step, *figures in measured
            ]
            runs.setdefault(precision, {})[seed] = run
            summary = summarise(run, args)
            log(
                f"{precision:26s} seed {seed}: reward {summary['start_reward']:.3f}"
                f" -> {summary['final_reward']:.3f}, skipped"
                f" {summary['skipped']}, scale {summary['final_scale']:g}, lost"
                f" {summary['max_lost_share']:.4%}",
                start,
                stages,
            )
    return runs, preflights


def summarise(run, args) -> dict:
    """A run's figures: its start and final reward, skips, scale, mismatch, loss."""
    rewards = np.asarray(run["reward"])
    shares = [u["share"] for u in run["underflow"]]
    lost = [u["lost"] for u in run["underflow"]]
    return {
        "start_reward": float(rewards[: args.window_start].mean()),
        "final_reward": float(rewards[-args.window_final :].mean()),
        "skipped": run["skipped"][-1],
        "final_scale": run["scale"][-1],
        "mean_abs_log_prob_diff": float(
            np.mean([m["abs_log_prob_diff"] for m in run["mismatch"]])
        ),
        "max_abs_log_ratio": float(
            np.max([m["max_abs_log_ratio"] for m in run["mismatch"]])
        ),
        "mean_lost_share": float(np.mean(shares)),
        "max_lost_share": float(np.max(shares)),
        "max_lost": int(np.max(lost)),
    }


# The short version the slow test runs (`tests/test_rl_float16.py`).

SHORT = {
    "pretrain_steps": 30,
    "pretrain_batch": 16,
    "prompts": 4,
    "group": 8,
    "new_tokens": 16,
    "steps": 12,
    "learning_rate": 3e-4,
    "window": 4,
}


def short_run(seed: int) -> dict:
    """A brief pretraining, the mismatch at one length, a short float16 RL run.

    Returns the float16 and bfloat16 mean |Δ log p| and their ratio, and the
    float16 + lossscale run's rewards, its start and final reward (the means of
    the first and last `SHORT["window"]` steps), skipped steps and final scale.
    """
    params, _ = rl.pretrain(
        SHORT["pretrain_steps"], seed=seed, batch=SHORT["pretrain_batch"], evals=1
    )
    _, held = rl.language_model.corpus()
    count = SHORT["prompts"] * SHORT["group"]
    prompts = next(rl.prompt_stream(held, count, 16, seed=seed + 1))
    length = SHORT["new_tokens"]
    mismatch = measure_mismatch(
        params, prompts, [length], seed=seed, dtypes=("float16", "bfloat16")
    )
    float16 = mismatch["float16"][length]["abs_log_prob_diff"]
    bfloat16 = mismatch["bfloat16"][length]["abs_log_prob_diff"]
    run = rl.fine_tune(
        params,
        "float16 + lossscale",
        steps=SHORT["steps"],
        seed=seed,
        prompts=SHORT["prompts"],
        group=SHORT["group"],
        new_tokens=length,
        learning_rate=SHORT["learning_rate"],
        run_preflight=False,
    )
    window = SHORT["window"]
    return {
        "float16_abs_log_prob_diff": float16,
        "bfloat16_abs_log_prob_diff": bfloat16,
        "ratio": float16 / bfloat16,
        "rewards": run["reward"],
        "start_reward": float(np.mean(run["reward"][:window])),
        "final_reward": float(np.mean(run["reward"][-window:])),
        "skipped": run["skipped"][-1],
        "final_scale": run["scale"][-1],
    }


def short_main(args) -> dict:
    """`--short-seeds`: the slow test's short version over seeds, timed."""
    start = time.perf_counter()
    stages = []
    runs = {}
    for seed in args.short_seeds:
        runs[seed] = short_run(seed)
        r = runs[seed]
        log(
            f"short, seed {seed}: |Δ log p| float16 / bfloat16 {r['ratio']:.3f},"
            f" reward {r['start_reward']:.3f} -> {r['final_reward']:.3f}",
            start,
            stages,
        )
    results = {
        "meta": {
            "command": " ".join(
                ["python", "examples/rl_float16/rl_fine_tuning.py", *sys.argv[1:]]
            ),
            "versions": versions(),
            "machine": machine(),
            "stages": stages,
            "load_average_end": os.getloadavg(),
        },
        "settings": SHORT,
        "runs": runs,
    }
    rises = [r["final_reward"] - r["start_reward"] for r in runs.values()]
    ratios = [r["ratio"] for r in runs.values()]
    lines = [
        "# RL fine-tuning in float16, the short version (the slow test's)",
        "",
        f"`{results['meta']['command']}`: {SHORT}. Per seed: the pretraining, the"
        " prompts and the sampling. A seed's wall and CPU time include its"
        " compiles (the first seed's most).",
        "",
        "| seed | float16 / bfloat16 mean \\|Δ log p\\| | start reward | final reward |"
        " rise | skipped | final scale | wall s | CPU s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    previous = {"wall_s": 0.0, "cpu_s": 0.0}
    for (seed, r), stage in zip(runs.items(), stages, strict=True):
        lines.append(
            f"| {seed} | {r['ratio']:.3f} | {r['start_reward']:.3f} |"
            f" {r['final_reward']:.3f} | {r['final_reward'] - r['start_reward']:.3f} |"
            f" {r['skipped']} | {r['final_scale']:g} |"
            f" {stage['wall_s'] - previous['wall_s']:.0f} |"
            f" {stage['cpu_s'] - previous['cpu_s']:.0f} |"
        )
        previous = stage
    lines += [
        "",
        f"Rise: smallest {min(rises):.3f}, largest {max(rises):.3f}. Ratio: largest"
        f" {max(ratios):.3f}.",
    ]
    table = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(results, f)
    with open(args.out + ".md", "w") as f:
        f.write(table)
    print(table)
    return results


def machine() -> dict:
    """The CPU and load: the benchmark's timings mean little without them."""
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                line.split(":", 1)[1].strip() for line in f if "model name" in line
            )
    except (OSError, StopIteration):
        pass
    return {
        "cpu": model,
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def versions() -> dict:
    """The versions of lossscale and the packages a run depends on."""
    found = {"lossscale": lossscale.__version__}
    for package in ("jax", "jaxlib", "flax", "optax", "numpy", "matplotlib"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def main(argv=None):
    """Pretrains, fine-tunes in each precision and seed, and writes the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pretrain-steps", type=int, default=200)
    parser.add_argument("--lengths", default="16,32,112")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--underflow-every", type=int, default=10)
    parser.add_argument("--sweep", default="1,10,100,1000,10000,100000")
    parser.add_argument("--window-start", type=int, default=5)
    parser.add_argument("--window-final", type=int, default=10)
    parser.add_argument("--precisions", default=",".join(rl.SHORT_NAMES))
    parser.add_argument("--quick", action="store_true", help="no plot")
    parser.add_argument(
        "--short-seeds",
        default="",
        help="only the slow test's short version, over these seeds (e.g. 0,1,2,3,4)",
    )
    parser.add_argument("--out", default="benchmarks/results/rl_fine_tuning")
    args = parser.parse_args(argv)
    args.lengths = [int(n) for n in args.lengths.split(",")]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.sweep = [int(float(f)) for f in args.sweep.split(",")]
    args.precisions = [rl.SHORT_NAMES[p] for p in args.precisions.split(",")]
    if args.short_seeds:
        args.short_seeds = [int(s) for s in args.short_seeds.split(",")]
        return short_main(args)
    start = time.perf_counter()
    results = {
        "meta": {
            "command": " ".join(
                ["python", "examples/rl_float16/rl_fine_tuning.py", *sys.argv[1:]]
            )
            if argv is None
            else "main(" + repr(argv) + ")",
            "versions": versions(),
            "machine": machine(),
            "backend": jax.default_backend(),
            "load_average_start": os.getloadavg(),
        },
        "args": vars(args),
    }

    stages = results["meta"]["stages"] = []
    params, held_out = rl.pretrain(args.pretrain_steps, seed=0)
    results["pretrain"] = {"steps": args.pretrain_steps, "held_out_loss": held_out}
    log(
        f"pretrained {args.pretrain_steps} steps: held-out {held_out:.4f}",
        start,
        stages,
    )

    _, held = rl.language_model.corpus()
    prompts = next(rl.prompt_stream(held, 64, args.prompt_length, seed=1))
    init = jax.jit(rl.language_model.ByteLM().init)  # eager, it dispatches op by op
    initial = init(jax.random.key(0), prompts)["params"]
    results["mismatch"] = {
        "pretrained": measure_mismatch(params, prompts, args.lengths),
        "initialisation": measure_mismatch(initial, prompts, args.lengths),
        # The control: a sampler that rounds where the trainer does.
        "pretrained, sampler with the trainer's softmax": measure_mismatch(
            params, prompts, [args.new_tokens], attention="softmax"
        ),
    }
    log("mismatch measured", start, stages)

    runs, preflights = rl_runs(params, args, start, stages)
    results["runs"] = runs
    results["summary"] = {
        precision: {seed: summarise(run, args) for seed, run in seeds.items()}
        for precision, seeds in runs.items()
    }
    results["preflight"] = preflights

    # One batch, sampled in float32 from the pretrained model.
    data, _ = rl.language_model.corpus()
    batch = rl.rollout(
        params,
        next(rl.prompt_stream(data, 8, args.prompt_length, seed=0)),
        jax.random.key(0),
        compute=F32,
        group=8,
        new_tokens=args.new_tokens,
    )
    results["sweep"] = sweep(params, batch, args.prompt_length, args.sweep)
    results["preflight_at_scale"] = {
        "factor": 10_000,
        **preflight_at_scale(params, batch, args, 10_000),
    }
    log("sweep and preflight at scale done", start, stages)

    results["meta"].update(
        wall_s=time.perf_counter() - start,
        cpu_s=cpu_seconds(),
        load_average_end=os.getloadavg(),
    )
    write(results, args)
    return results


def write(results, args):
    """Writes the results as `.json` and `.md` (and the figure, `plot`)."""
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(results, f)
    table = markdown(results, args)
    with open(args.out + ".md", "w") as f:
        f.write(table)
    print(table)
    if not args.quick:
        plot(results, args.out + ".png")


def markdown(results, args) -> str:
    """The results as the Markdown report `--out`.md holds."""
    meta = results["meta"]
    v = meta["versions"]
    m = meta["machine"]
    lines = [
        "# RL fine-tuning in float16: the mismatch, the runs, underflow",
        "",
        f"`{meta['command']}`: lossscale {v['lossscale']}, jax {v['jax']}, flax"
        f" {v.get('flax')}, optax {v.get('optax')}; {meta['backend']}, {m['cpu']},"
        f" {m['usable_cpus']} usable of {m['cpu_count']} CPUs; Python {m['python']}.",
        f"Wall time {meta['wall_s']:.0f} s, CPU time {meta['cpu_s']:.0f} s; load"
        f" average {meta['load_average_start'][0]:.1f} at the start,"
        f" {meta['load_average_end'][0]:.1f} at the end (a shared machine: the"
        " wall time depends on it).",
        "",
        f"Pretrained {results['pretrain']['steps']} steps in float32 (held-out"
        f" {results['pretrain']['held_out_loss']:.3f} nats/byte).",
        "",
        "## The training-inference mismatch",
        "",
        "From the same float32 parameters: the sampler (prefill, then decode with a"
        " KV cache) and the trainer (the full-sequence forward), both in the dtype."
        f" 64 held-out prompts of {args.prompt_length} bytes, continuations sampled"
        " at temperature 1."
        " |Δ log p|: the mean over generated tokens of |log p_trainer - log"
        " p_sampler| of the sampled byte; KL: KL(sampler || trainer) of the next-byte"
        " distributions, per token and summed per sequence; max / min ratio: the"
        " largest and smallest p_trainer / p_sampler over the tokens. The last rows"
        " are a control: a sampler that normalises the attention weights before"
        " rounding them, as the trainer does, instead of as an attention kernel"
        " does.",
        "",
        "| model | dtype | new bytes | mean \\|Δ log p\\| | KL per token |"
        " KL per sequence | max ratio | min ratio | float16 / bfloat16 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model, by_dtype in results["mismatch"].items():
        for dtype, by_length in by_dtype.items():
            for length, f in by_length.items():
                ratio = ""
                if dtype == "float16":
                    bf = by_dtype["bfloat16"][length]["abs_log_prob_diff"]
                    ratio = f"{f['abs_log_prob_diff'] / bf:.3f}"
                lines.append(
                    f"| {model} | {dtype} | {length} | {f['abs_log_prob_diff']:.3g} |"
                    f" {f['kl_per_token']:.3g} | {f['kl_per_sequence']:.3g} |"
                    f" {f['max_ratio']:.5f} | {f['min_ratio']:.5f} | {ratio} |"
                )
    lines += [
        "",
        "## RL fine-tuning",
        "",
        f"The lipogram task: {args.new_tokens} bytes after a {args.prompt_length}-byte"
        " prompt from the documentation, reward 1 without the letter e. 8 prompts x"
        f" 8 samples a step, {args.steps} steps, Adam {args.learning_rate:g} (clip at"
        " 1), clipped GRPO objective with the sampler's log-probs; sampler and"
        " trainer in the run's dtype, parameters float32. Start: the mean reward of"
        f" the first {args.window_start} steps; final: of the last"
        f" {args.window_final}. Lost to underflow: non-zero in the float32"
        " reference gradient, zero in the run's (every"
        f" {args.underflow_every} steps and the last).",
        "",
        "| run | start reward per seed | final reward per seed | mean final |"
        " skipped | final scale | mean \\|Δ log p\\| | lost to underflow (max share,"
        " elements) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for precision, seeds in results["summary"].items():
        s = list(seeds.values())

        def cells(template, s=s):
            return ", ".join(template.format(**x) for x in s)

        mean_final = np.mean([x["final_reward"] for x in s])
        lines.append(
            f"| {precision} | {cells('{start_reward:.3f}')} |"
            f" {cells('{final_reward:.3f}')} | {mean_final:.3f} |"
            f" {cells('{skipped}')} | {cells('{final_scale:g}')} |"
            f" {cells('{mean_abs_log_prob_diff:.2g}')} |"
            f" {cells('{max_lost_share:.4%} ({max_lost})')} |"
        )
    finals = {
        precision: [x["final_reward"] for x in seeds.values()]
        for precision, seeds in results["summary"].items()
    }
    if "float32" in finals:
        low, high = min(finals["float32"]), max(finals["float32"])
        lines += [
            "",
            f"float32's seeds end between {low:.3f} and {high:.3f}; mean final reward"
            " of each run against that range: "
            + "; ".join(
                f"{precision} {np.mean(values):.3f}"
                f" ({'within' if low <= np.mean(values) <= high else 'outside'})"
                for precision, values in finals.items()
                if precision != "float32"
            )
            + ".",
        ]
    sweep_rows = results["sweep"]
    names = [k for k in sweep_rows if k != "tokens"]
    lines += [
        "",
        "## Lost to underflow against the tokens the loss averages over",
        "",
        f"At the pretrained parameters, one batch of 64 x {args.new_tokens} generated"
        " bytes sampled in float32: the loss divided by this many tokens (the"
        " batch's count times"
        " 1, 10, ...: a micro-batch normalised by a larger batch's count). Share of"
        " the float32 gradient's non-zero elements that are zero in the run's.",
        "",
        "| tokens averaged over | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for i, tokens in enumerate(sweep_rows["tokens"]):
        cells = []
        for name in names:
            row = sweep_rows[name][i]
            cell = f"{row['share']:.2%}" + ("" if row["finite"] else " (not finite)")
            cells.append(cell)
        lines.append(f"| {tokens:,} | " + " | ".join(cells) + " |")
    lines += ["", "## What `preflight` says", ""]
    for precision, summary in results["preflight"].items():
        lines.append(
            f"- {precision}: codes {summary['codes'] or 'none'}, scale"
            f" {summary['scale']}"
        )
    at_scale = results["preflight_at_scale"]
    for name in ("no loss scaling", "dynamic"):
        summary = at_scale[name]
        lines.append(
            f"- float16, the loss divided by {at_scale['factor']:,} times more"
            f" tokens, {name}: codes {summary['codes'] or 'none'}, scale"
            f" {summary['scale']}"
        )
    return "\n".join(lines) + "\n"


def plot(results, path):
    """Plots each precision's reward and mismatch against the step to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 3, figsize=(16, 9))
    colours = dict(
        zip(
            results["runs"],
            plt.rcParams["axes.prop_cycle"].by_key()["color"],
            strict=False,
        )
    )

    ax = axes[0, 0]
    for precision, seeds in results["runs"].items():
        rewards = np.array([run["reward"] for run in seeds.values()])
        smooth = np.array(
            [np.convolve(r, np.ones(5) / 5, mode="valid") for r in rewards]
        )
        steps = np.arange(smooth.shape[1]) + 4
        ax.plot(steps, smooth.mean(0), color=colours[precision], label=precision)
        ax.fill_between(
            steps, smooth.min(0), smooth.max(0), color=colours[precision], alpha=0.15
        )
    ax.set(
        title="reward (5-step mean; line: mean of seeds, band: their range)",
        xlabel="step",
    )
    ax.legend()

    ax = axes[0, 1]
    for precision, seeds in results["runs"].items():
        for i, run in enumerate(seeds.values()):
            ax.plot(
                [m["abs_log_prob_diff"] for m in run["mismatch"]],
                color=colours[precision],
                label=precision if i == 0 else None,
                alpha=0.8,
            )
    ax.set(title="mismatch during RL: mean |Δ log p|", xlabel="step", yscale="log")

    ax = axes[0, 2]
    for precision, seeds in results["runs"].items():
        for i, run in enumerate(seeds.values()):
            u = run["underflow"]
            ax.plot(
                [x["step"] for x in u],
                [100 * x["share"] for x in u],
                "o-",
                color=colours[precision],
                label=precision if i == 0 else None,
            )
    ax.set(title="gradient elements lost to underflow (%)", xlabel="step")
    ax.legend()

    ax = axes[1, 0]
    for model, style in (("pretrained", "o-"), ("initialisation", "s--")):
        for dtype, by_length in results["mismatch"][model].items():
            lengths = [int(n) for n in by_length]
            ax.plot(
                lengths,
                [f["abs_log_prob_diff"] for f in by_length.values()],
                style,
                label=f"{dtype}, {model}",
            )
    ax.set(
        title="sampler vs trainer: mean |Δ log p|",
        xlabel="generated bytes",
        yscale="log",
    )
    ax.legend(fontsize=8)

    ax = axes[1, 1]
    sweep_rows = results["sweep"]
    for name in (k for k in sweep_rows if k != "tokens"):
        ax.plot(
            sweep_rows["tokens"],
            [100 * row["share"] for row in sweep_rows[name]],
            "o-",
            label=name,
        )
    ax.set(
        title="lost to underflow vs tokens the loss averages over (%)",
        xlabel="tokens",
        xscale="log",
    )
    ax.legend()

    ax = axes[1, 2]
    for precision, seeds in results["runs"].items():
        for i, run in enumerate(seeds.values()):
            ax.plot(
                run["scale"],
                color=colours[precision],
                label=precision if i == 0 else None,
            )
    ax.set(title="loss scale", xlabel="step", yscale="log")
    ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


if __name__ == "__main__":
    main()
