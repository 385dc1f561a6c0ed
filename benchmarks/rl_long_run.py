"""GRPO for hundreds of steps on a GPU: float32, bfloat16, float16 + lossscale.

    OUT=/tmp/rl RL_BUDGET=330 bash benchmarks/gpu_run.sh rl   # the GPU run
    QUICK=1 OUT=/tmp/rl bash benchmarks/gpu_run.sh rl         # a CPU smoke run, 3 min
    python benchmarks/rl_long_run.py --budget 330 --out-dir benchmarks/results/gpu

`examples/rl_float16.py`'s task and step (the lipogram reward; its KV-cached sampler
and its trainer, both in the run's dtype; float32 master weights; the clipped GRPO
objective; `lossscale.apply_gradients`) on a larger model, pretrained here in
float32 on `pydoc_data.topics`, for as many steps as a wall-clock budget allows.
The runs, in this order, each written out as soon as it ends: bfloat16 and float16
+ lossscale, seeds 0 and 1 (bfloat16 0, float16 0, bfloat16 1, float16 1); float32,
seed 0; float16 without loss scaling, if time is left. Every run starts from the
same pretrained parameters and has the same number of steps. Per step: the mean
reward, the mismatch (mean |log p_trainer - log p_sampler| of the sampled bytes,
the largest importance ratio p_trainer / p_sampler), the global norm of the
unscaled gradients, the skipped steps and the loss scale. Results:
`rl_long_run_<device>.{json,md,png}` in `--out-dir`, rewritten after each run (the
.md is written to be pasted into `docs/guides/rl_float16.md`).

Time. The budget (`--budget` seconds, default `$RL_BUDGET` or 330) counts from
`--start-time` (the shell's start, so that JAX's start counts) and is spent as:

1. pretraining: its compile, then `--pretrain-seconds` of steps;
2. calibration: per required dtype, a run of `--calibration-steps` (seed 1000,
   thrown away) that compiles its sampler and train step and times the steps
   after them;
3. the step count of every run: the time left, less each run's measured overhead
   and `--reserve` seconds for the last write, divided by the sum over the
   required runs of their measured time per step, with a 10% margin; at most
   `--max-steps`. A run that would not fit is not started; a run that reaches the
   deadline (checked every 16 steps) stops there, keeps its steps and is marked
   cut. Unscaled float16 runs only if its compile (estimated as float16 +
   lossscale's) and its steps fit.

Sizing, an estimate (the results record what happened). The model is the H200
language model's: 8 blocks of width 512, 8 heads, 25M parameters
(`benchmarks/results/language_model_h200.md`: 0.78M tokens/s in float32 training at
128 x 256 bytes a step, about 42 ms a step). Pretraining at 128 x 128 bytes a step
takes about 20-25 ms a step, so 25 s are about 1,100 steps, 18M bytes: as many as
that run's 16M, which reached 1.69 nats/byte; enough for text (text has an "e" in
most 32-byte spans: the reward starts low and can rise). A GRPO step of 8 prompts x
8 samples is the trainer's forward and backward over 64 x 48 bytes (3,000 tokens, a
tenth of an LM step's: a few ms) and the sampler's prefill and 32 decode steps. The
sampler compiled for an H100 (below) is about 300 fusions: some 150 small kernels a
decode step at batch 64, bound by launch latency rather than FLOPs, about 0.5-1 ms a
byte: 20-40 ms a step in any dtype (a larger batch would cost little more; 8 x 8
keeps the CPU runs' settings). Compiles: the programs compiled for an H100 without
one (`jax.experimental.topologies`, jaxlib 0.10.2, on a loaded 2-core CPU) took
18-40 s per sampler and 36-65 s per train step; on the GPU's host, 16 cores and
autotuning, perhaps 20-40 s a dtype. So: 330 s, less 10 s (JAX's start), 45 s
(pretraining and its compiles), 120 s (three dtypes' compiles and calibration)
and 15 s (writes, reserve), leave about 140 s for 5 runs: 28 s, or 500-900 steps, a
run. The H200 language model's size fits, and is the default; smaller ones are
`--width`, `--layers`, `--heads`. The same compile found that XLA:GPU could not
tile 64 x 47 rows (the trainer's forward of 16 + 32 - 1 bytes): the example's
trainer now runs all 48 positions and drops the last one's logits.

float32 matmuls. XLA on an H100/H200 computes float32 dots in TF32 by default (10
mantissa bits, float16's), which would give the float32 run a float16-sized
mismatch: the float32 runs run under `jax.default_matmul_precision("highest")`
(true float32). The 16-bit runs keep the default: their one float32 dot, the output
projection, rounds the same 16-bit activations and float32 embedding in the
sampler and the trainer alike. The pretraining keeps the default too.

`--quick`: the example's model (2 blocks of 64, 4 heads), 10 s of pretraining at
32 x 128 bytes, calibration over 6 steps, a budget of 180 s: on a 2-core CPU, runs
of a few dozen steps, the whole path end to end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tarfile
import time
import traceback

PROCESS_START = time.time()  # before JAX's import: its start counts

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples")
)
import rl_fine_tuning  # noqa: E402
import rl_float16 as rl  # noqa: E402

language_model = rl.language_model

COLOURS = {
    "float32": "black",
    "bfloat16": "tab:red",
    "float16 + lossscale": "tab:blue",
    "float16, no loss scaling": "tab:green",
}
# Per step, from `rl.fine_tune`'s record: (column, where it is).
COLUMNS = {
    "reward": ("reward", None),
    "abs_log_prob_diff": ("mismatch", "abs_log_prob_diff"),
    "max_ratio": ("mismatch", "max_ratio"),
    "min_ratio": ("mismatch", "min_ratio"),
    "kl_per_token": ("mismatch", "kl_per_token"),
    "grad_norm": ("grad_norm", None),
    "scale": ("scale", None),
    "skipped": ("skipped", None),
    "loss": ("loss", None),
}
CHECK_EVERY = 16  # steps between the deadline's checks (each waits for the device)
FLOAT32_DOTS = "highest"  # the float32 run's `jax_default_matmul_precision`


class Clock:
    """Seconds since the start and to the deadline (`budget - reserve` after it)."""

    def __init__(self, start: float, budget: float, reserve: float):
        self.start = start
        self.deadline = start + budget - reserve

    def elapsed(self) -> float:
        return time.time() - self.start

    def left(self) -> float:
        return self.deadline - time.time()


def say(clock: Clock, message: str) -> None:
    print(f"[{clock.elapsed():5.0f} s] {message}", file=sys.stderr, flush=True)


# 1. Pretraining, for a fixed time.


def pretrain_within(args, clock: Clock) -> tuple[dict, dict]:
    """float32 pretraining for `args.pretrain_seconds` after its compile.

    `benchmarks/language_model.py`'s model, batches and loss; Adam with warmup and
    a cosine decay over `args.pretrain_max_steps` (the time may end it first),
    clipped at norm 1. Returns the parameters and a record.
    """
    data, held_out = language_model.corpus()
    model = language_model.ByteLM(
        width=args.width, layers=args.layers, heads=args.heads
    )
    stream = language_model.batches(data, args.pretrain_batch, 128, seed=0)
    params = jax.jit(model.init)(jax.random.key(0), next(stream)[0])["params"]
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        args.pretrain_learning_rate,
        min(100, args.pretrain_max_steps // 10),
        args.pretrain_max_steps,
        args.pretrain_learning_rate / 10,
    )
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))
    opt_state = tx.init(params)

    def loss_fn(params, x, y):
        return language_model.cross_entropy(model.apply({"params": params}, x), y)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    begin = time.time()
    losses = []
    while len(losses) < args.pretrain_max_steps:
        params, opt_state, loss = step(params, opt_state, *next(stream))
        losses.append(loss)
        if len(losses) == 1:
            jax.block_until_ready(params)
            compiled = time.time()
            say(clock, f"pretraining step compiled in {compiled - begin:.1f} s")
        elif len(losses) % 25 == 0:
            jax.block_until_ready(params)
            if time.time() - compiled >= args.pretrain_seconds or clock.left() < 0:
                break
    jax.block_until_ready(params)
    seconds = time.time() - compiled
    losses = [float(x) for x in jax.device_get(losses)]
    evaluate = jax.jit(loss_fn)
    held = language_model.batches(held_out, 64, 128, seed=1)
    held_loss = float(np.mean([evaluate(params, *next(held)) for _ in range(4)]))
    record = {
        "steps": len(losses),
        "batch": args.pretrain_batch,
        "context": 128,
        "learning_rate": args.pretrain_learning_rate,
        "compile_s": compiled - begin,
        "steps_s": seconds,
        "ms_per_step": 1000 * seconds / max(1, len(losses) - 1),
        "train_loss_last_50": float(np.mean(losses[-50:])),
        "held_out_loss": held_loss,
        "losses": losses,
        "parameters": int(sum(x.size for x in jax.tree.leaves(params))),
    }
    say(
        clock,
        f"pretrained {len(losses)} steps in {seconds:.1f} s: train loss"
        f" {record['train_loss_last_50']:.3f}, held-out {held_loss:.3f} nats/byte",
    )
    return params, record


# 2. Calibration, 3. the runs.


def fine_tune(params, precision, seed, steps, args, on_step):
    """`rl.fine_tune` without preflight; float32's dots in float32 (see above)."""
    compute, _ = rl.PRECISIONS[precision]
    with (
        jax.default_matmul_precision(FLOAT32_DOTS)
        if compute == rl.F32
        else contextlib.nullcontext()
    ):
        return rl.fine_tune(
            params,
            precision,
            steps=steps,
            seed=seed,
            prompts=args.prompts,
            group=args.group,
            learning_rate=args.learning_rate,
            heads=args.heads,
            run_preflight=False,
            on_step=on_step,
        )


def calibrate(params, precision, args) -> dict:
    """Compiles `precision`'s sampler and step; times the steps after them."""
    first, last = 2, args.calibration_steps - 1
    marks = {}

    def on_step(step, params, batch, loss_scale):
        if step in (first, last):
            jax.block_until_ready(params)
            marks[step] = time.time()

    begin = time.time()
    fine_tune(params, precision, 1000, args.calibration_steps, args, on_step)
    end = time.time()
    per_step = (marks[last] - marks[first]) / (last - first)
    return {
        "compile_s": marks[first] - begin,  # with its first 2 steps
        "per_step_s": per_step,
        # What a run costs beyond its steps: the record's transfer at the end.
        "overhead_s": max(0.0, end - marks[last] - per_step),
        "wall_s": end - begin,
    }


def texts(batch, group: int) -> list[dict]:
    """Three of a batch's samples (of different prompts), as text, with rewards."""
    tokens, _, _, rewards = batch
    rows = [0, group, 2 * group][: max(1, tokens.shape[0] // group)]
    tokens, rewards = jax.device_get((tokens[np.asarray(rows)], rewards))
    return [
        {
            "prompt": printable(tokens[i, :16]),
            "continuation": printable(tokens[i, 16:]),
            "reward": float(rewards[row]),
        }
        for i, row in enumerate(rows)
    ]


def printable(tokens) -> str:
    """Bytes as text for a Markdown line: control bytes and invalid UTF-8 escaped."""
    text = bytes(np.asarray(tokens).tolist()).decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def one_run(params, precision, seed, steps, args, clock: Clock) -> dict:
    """One RL run of `steps`, stopped at the deadline; its columns and summary."""
    samples, cut = {}, []

    def on_step(step, params, batch, loss_scale):
        if step in (0, steps - 1):
            samples["first" if step == 0 else "last"] = texts(batch, args.group)
        if step and step % CHECK_EVERY == 0:
            jax.block_until_ready(params)
            if clock.left() < 0:
                cut.append(step)
                return True
        return False

    begin = time.time()
    run = fine_tune(params, precision, seed, steps, args, on_step)
    wall = time.time() - begin
    columns = {
        name: [r if key is None else r[key] for r in run[source]]
        for name, (source, key) in COLUMNS.items()
    }
    return {
        "precision": precision,
        "seed": seed,
        "planned_steps": steps,
        "steps": len(columns["reward"]),
        "cut": bool(cut),
        "wall_s": wall,
        "samples": samples,
        "summary": summarise(columns),
        "per_step": columns,
    }


def summarise(columns: dict) -> dict:
    """A run's figures: first and last tenth, per tenth, extremes."""
    reward = np.asarray(columns["reward"], np.float64)
    n = len(reward)
    if n == 0:
        return {}
    tenth = max(1, n // 10)
    parts = min(10, n)

    def per_tenth(name, reduce=np.mean):
        values = np.asarray(columns[name], np.float64)
        return [float(reduce(part)) for part in np.array_split(values, parts)]

    dlogp = np.asarray(columns["abs_log_prob_diff"], np.float64)
    norms = np.asarray(columns["grad_norm"], np.float64)
    finite = norms[np.isfinite(norms)]
    return {
        "start_reward": float(reward[:tenth].mean()),
        "final_reward": float(reward[-tenth:].mean()),
        # The standard error of the last tenth's mean, from its steps' spread.
        "final_reward_se": float(reward[-tenth:].std() / np.sqrt(tenth)),
        "dlogp_first": float(dlogp[:tenth].mean()),
        "dlogp_last": float(dlogp[-tenth:].mean()),
        "max_ratio": float(np.max(columns["max_ratio"])),
        "min_ratio": float(np.min(columns["min_ratio"])),
        "grad_norm_median": float(np.median(finite)) if finite.size else float("nan"),
        "grad_norm_max": float(finite.max()) if finite.size else float("nan"),
        "skipped": int(columns["skipped"][-1]),
        "final_scale": float(columns["scale"][-1]),
        "reward_tenths": per_tenth("reward"),
        "reward_tenths_se": [
            float(part.std() / np.sqrt(len(part)))
            for part in np.array_split(reward, parts)
        ],
        "dlogp_tenths": per_tenth("abs_log_prob_diff"),
        "max_ratio_tenths": per_tenth("max_ratio", np.max),
    }


# Against float32.


def comparisons(runs: list[dict]) -> list[str]:
    """Each precision's reward against float32's, and its mismatch over the run."""
    done = [r for r in runs if r.get("summary") and not r["cut"]]
    reference = [r for r in done if r["precision"] == "float32"]
    if not reference:
        return ["No complete float32 run: no comparison."]
    ref = reference[0]["summary"]
    steps = reference[0]["steps"]
    low = ref["final_reward"] - 2 * ref["final_reward_se"]
    high = ref["final_reward"] + 2 * ref["final_reward_se"]
    lines = [
        f"float32 (seed {reference[0]['seed']}) ends at {ref['final_reward']:.3f}"
        f" (the mean of its last tenth; its range, plus or minus 2 standard errors of"
        f" that mean: {low:.3f} to {high:.3f}). Mean |Δ log p| {ref['dlogp_first']:.2e}"
        f" in the first tenth, {ref['dlogp_last']:.2e} in the last.",
    ]
    for precision in ("float16 + lossscale", "bfloat16", "float16, no loss scaling"):
        mine = [r for r in done if r["precision"] == precision and r["steps"] == steps]
        if not mine:
            continue
        finals = [r["summary"]["final_reward"] for r in mine]
        final = float(np.mean(finals))
        where = "within" if low <= final <= high else "outside"
        seeds = ", ".join(f"{f:.3f}" for f in finals)
        first = np.mean([r["summary"]["dlogp_first"] for r in mine])
        last = np.mean([r["summary"]["dlogp_last"] for r in mine])
        lines.append(
            f"{precision}: ends at {final:.3f} (seeds: {seeds}), {where} float32's"
            f" range; {departure(ref, [r['summary'] for r in mine], steps)}"
            f" Mean |Δ log p| {first:.2e} in the first tenth, {last:.2e} in the last."
        )
    return lines


def departure(ref: dict, summaries: list[dict], steps: int) -> str:
    """Where the seeds' mean reward per tenth leaves float32's, and stays out.

    Out: further from float32's tenth than 3 times the two tenths' combined
    standard error (each from its steps' spread, the seeds' pooled): over 10
    tenths, 2 would call a departure by chance in about 40% of runs, 3 in 3%.
    """
    tenths = len(ref["reward_tenths"])
    if any(len(s["reward_tenths"]) != tenths for s in summaries):
        return "tenths differ: no comparison."
    out = []
    for k in range(tenths):
        mean = np.mean([s["reward_tenths"][k] for s in summaries])
        se = np.sqrt(np.mean([s["reward_tenths_se"][k] ** 2 for s in summaries]))
        se /= np.sqrt(len(summaries))
        gap = abs(mean - ref["reward_tenths"][k])
        out.append(gap > 3 * np.sqrt(se**2 + ref["reward_tenths_se"][k] ** 2))
    size = steps / tenths
    if not any(out):
        return "within float32's reward in every tenth of the run."
    first = next(k for k in range(tenths) if all(out[k:])) if out[-1] else None
    if first is not None:
        return (
            f"departs from float32's reward from tenth {first + 1} on (step"
            f" {int(first * size)} of {steps})."
        )
    listed = ", ".join(str(k + 1) for k in range(tenths) if out[k])
    return f"outside float32's reward in tenth(s) {listed}, within at the end."


# Writing.


def write(results: dict, prefix: str) -> None:
    """The .json, the .md and the .png; packs them if `$PACK` names a file."""
    with open(prefix + ".json", "w") as f:
        json.dump(results, f)
    with open(prefix + ".md", "w") as f:
        f.write(markdown(results))
    try:
        plot(results, prefix + ".png")
    except Exception:  # the numbers matter more than the figure
        results["meta"]["plot_error"] = traceback.format_exc()
    pack = os.environ.get("PACK")
    if pack:
        folder = os.path.dirname(prefix) or "."
        with tarfile.open(pack, "w:gz") as tar:
            for name in sorted(os.listdir(folder)):
                path = os.path.join(folder, name)
                if os.path.isfile(path) and not os.path.samefile(path, pack):
                    tar.add(path, arcname=name)


def markdown(results: dict) -> str:
    meta, pre = results["meta"], results.get("pretraining")
    v = meta["versions"]
    lines = [
        "# GRPO over hundreds of steps: float32, bfloat16, float16 + lossscale",
        "",
        f"`{meta['command']}` (`{meta['python_command']}`): {meta['device']}"
        f" ({meta['backend']}), jax {v.get('jax')}, jaxlib {v.get('jaxlib')}, flax"
        f" {v.get('flax')}, optax {v.get('optax')}, lossscale {v.get('lossscale')},"
        f" Python {meta['machine']['python']}, {meta['machine']['usable_cpus']} CPUs."
        f" Wall time {meta.get('wall_s', float('nan')):.0f} s of a budget of"
        f" {meta['budget_s']:.0f} s, from the shell's start: JAX's start,"
        " pretraining, compiles, calibration and the runs.",
        "",
    ]
    if pre:
        lines += [
            f"Model: `benchmarks/language_model.py`'s ByteLM, {meta['layers']} blocks"
            f" of width {meta['width']}, {meta['heads']} heads,"
            f" {pre['parameters'] / 1e6:.1f}M parameters, float32 master weights."
            f" Pretrained in float32 for {pre['steps']} steps ({pre['steps_s']:.0f} s"
            f" after a {pre['compile_s']:.0f} s compile) of {pre['batch']} x 128 bytes"
            f" of `pydoc_data.topics`, Adam {pre['learning_rate']:g}: train loss"
            f" {pre['train_loss_last_50']:.3f}, held-out {pre['held_out_loss']:.3f}"
            " nats/byte.",
            "",
        ]
    lines += [
        "RL: `examples/rl_float16.py`'s lipogram task (32 bytes after a 16-byte"
        " prompt, reward 1 without the letter e), "
        f"{meta['prompts']} prompts x {meta['group']} samples a step, one Adam"
        f" {meta['learning_rate']:g} update (clipped at norm 1) of the clipped GRPO"
        " objective; the sampler (prefill, then decode with a KV cache) and the"
        " trainer in the run's dtype; float32 matmuls in float32"
        " (`jax_default_matmul_precision=highest`, not TF32). float16 + lossscale:"
        " a dynamic scale from 2**15. Every run starts from the same pretrained"
        f" parameters; {meta.get('steps', '?')} steps each, from the calibration:",
        "",
        "| dtype | compile + 2 steps (s) | ms per step |",
        "|---|---|---|",
    ]
    for precision, c in results.get("calibration", {}).items():
        if "error" in c:
            reason = c["error"].strip().splitlines()[-1][:100]
            lines.append(f"| {precision} | failed: {reason} | |")
        else:
            lines.append(
                f"| {precision} | {c['compile_s']:.1f} | {1000 * c['per_step_s']:.1f} |"
            )
    lines += [
        "",
        "Start and final reward: the mean of the first and the last tenth of the"
        " steps; |Δ log p|: the mean over the sampled bytes of |log p_trainer - log"
        " p_sampler|, in the first and the last tenth; max ratio: the largest"
        " p_trainer / p_sampler over the run.",
        "",
        "| run | seed | steps | wall s | start reward | final reward |"
        " \\|Δ log p\\| first | \\|Δ log p\\| last | max ratio |"
        " grad norm (median) | skipped | final scale |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        s = r.get("summary")
        if "error" in r:
            lines.append(f"| {r['precision']} | {r['seed']} | failed: see the .json |")
            continue
        if "not_run" in r:
            lines.append(
                f"| {r['precision']} | {r['seed']} | not run: {r['not_run']} |"
            )
            continue
        if not s:
            lines.append(f"| {r['precision']} | {r['seed']} | 0 steps |")
            continue
        steps = f"{r['steps']}" + (" (cut)" if r["cut"] else "")
        lines.append(
            f"| {r['precision']} | {r['seed']} | {steps} | {r['wall_s']:.0f} |"
            f" {s['start_reward']:.3f} | {s['final_reward']:.3f} |"
            f" {s['dlogp_first']:.2e} | {s['dlogp_last']:.2e} | {s['max_ratio']:.4f} |"
            f" {s['grad_norm_median']:.3g} | {s['skipped']} | {s['final_scale']:g} |"
        )
    done = [r for r in results["runs"] if r.get("summary")]
    for title, key, fmt in (
        ("Mean reward per tenth of the run", "reward_tenths", "{:.3f}"),
        ("Mean \\|Δ log p\\| per tenth", "dlogp_tenths", "{:.2e}"),
        ("Largest p_trainer / p_sampler per tenth", "max_ratio_tenths", "{:.4f}"),
    ):
        if not done:
            break
        tenths = max(len(r["summary"][key]) for r in done)
        lines += [
            "",
            f"{title}:",
            "",
            "| run | seed | " + " | ".join(str(k + 1) for k in range(tenths)) + " |",
            "|---|---|" + "---|" * tenths,
        ]
        for r in done:
            cells = " | ".join(fmt.format(x) for x in r["summary"][key])
            lines.append(f"| {r['precision']} | {r['seed']} | {cells} |")
    lines += [
        "",
        "Against float32 (a run's reward per tenth departs where the seeds' mean is"
        " further from float32's than 3 times their combined standard error, from"
        " the steps' spread):",
        "",
    ]
    lines += [f"- {line}" for line in comparisons(results["runs"])]
    lines += [
        "",
        "Samples (seed 0; the first and the last step's batch; the continuation"
        " after `|`):",
        "",
    ]
    for r in done:
        if r["seed"] != results["runs"][0]["seed"]:
            continue
        for when, samples in r.get("samples", {}).items():
            for sample in samples[:2]:
                text = sample["prompt"] + "|" + sample["continuation"]
                text = text.replace("`", "'")
                lines.append(
                    f"- {r['precision']}, {when} step, reward {sample['reward']:g}:"
                    f" `{text}`"
                )
    return "\n".join(lines) + "\n"


def moving_mean(values, window: int) -> np.ndarray:
    values = np.asarray(values, np.float64)
    if window <= 1 or len(values) < window:
        return values
    return np.convolve(values, np.ones(window) / window, mode="valid")


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("reward", "reward (moving mean)", "linear", True),
        ("abs_log_prob_diff", "mean |Δ log p|, sampler vs trainer", "log", True),
        ("max_ratio", "largest p_trainer / p_sampler, minus 1", "log", False),
        ("grad_norm", "gradient norm, unscaled (moving mean)", "log", True),
        ("scale", "loss scale", "log", False),
        ("skipped", "skipped steps (total)", "linear", False),
    ]
    figure, axes = plt.subplots(2, 3, figsize=(16, 8))
    runs = [r for r in results["runs"] if r.get("summary")]
    for ax, (name, title, yscale, smooth) in zip(axes.ravel(), panels, strict=True):
        for r in runs:
            values = np.asarray(r["per_step"][name], np.float64)
            if name == "max_ratio":
                values = np.where(values > 1, values - 1, np.nan)
            if smooth:
                values = moving_mean(values, max(1, r["steps"] // 50))
            offset = (r["steps"] - len(values)) // 2
            ax.plot(
                offset + np.arange(len(values)),
                values,
                color=COLOURS.get(r["precision"]),
                linestyle="-" if r["seed"] == runs[0]["seed"] else "--",
                linewidth=1,
                label=f"{r['precision']}, seed {r['seed']}",
            )
        ax.set(title=title, xlabel="step", yscale=yscale)
    if runs:
        axes[0, 0].legend(fontsize=8)
    meta = results["meta"]
    figure.suptitle(
        f"GRPO, {meta['layers']} x {meta['width']} byte LM, {meta['device']},"
        f" jax {meta['versions'].get('jax')}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


# The whole stage.


def parse(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    default_budget = float(os.environ.get("RL_BUDGET", 0) or 0) or None
    add = parser.add_argument
    add(
        "--budget",
        type=float,
        default=default_budget,
        help="seconds from --start-time to the end (default: $RL_BUDGET, else 330;"
        " 180 with --quick)",
    )
    add(
        "--start-time",
        type=float,
        default=None,
        help="the shell's start, seconds since the epoch (default: this process's)",
    )
    add(
        "--reserve",
        type=float,
        default=15.0,
        help="seconds kept at the end for the last write and the exit",
    )
    add("--width", type=int, default=None, help="512 (64 with --quick)")
    add("--layers", type=int, default=None, help="8 (2 with --quick)")
    add("--heads", type=int, default=None, help="8 (4 with --quick)")
    add("--pretrain-seconds", type=float, default=None, help="25 (10 with --quick)")
    add("--pretrain-batch", type=int, default=None, help="128 (32 with --quick)")
    add(
        "--pretrain-learning-rate",
        type=float,
        default=None,
        help="1e-3 (3e-3 with --quick)",
    )
    add("--pretrain-max-steps", type=int, default=3000)
    add("--prompts", type=int, default=8, help="prompts per RL step")
    add("--group", type=int, default=8, help="samples per prompt")
    add("--learning-rate", type=float, default=1e-4, help="the RL step's Adam")
    add("--seeds", default="0,1", help="the bfloat16 and float16 runs' seeds")
    add("--calibration-steps", type=int, default=None, help="12 (6 with --quick)")
    add("--min-steps", type=int, default=5, help="even if they do not fit")
    add("--max-steps", type=int, default=2000)
    add("--margin", type=float, default=0.1, help="on the planned steps' time")
    add("--quick", action="store_true", help="a CPU smoke run (see the docstring)")
    add("--out-dir", default="benchmarks/results/gpu")
    args = parser.parse_args(argv)
    quick = {
        "budget": (330.0, 180.0),
        "width": (512, 64),
        "layers": (8, 2),
        "heads": (8, 4),
        "pretrain_seconds": (25.0, 10.0),
        "calibration_steps": (12, 6),
        "pretrain_batch": (128, 32),
        "pretrain_learning_rate": (1e-3, 3e-3),
    }
    for name, (full, small) in quick.items():
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick else full)
    args.seeds = [int(s) for s in args.seeds.split(",")]
    return args


def main(argv=None):
    args = parse(argv)
    clock = Clock(args.start_time or PROCESS_START, args.budget, args.reserve)
    backend = jax.default_backend()
    kind = jax.devices()[0].device_kind
    device = kind.split()[-1].lower() if backend == "gpu" else backend
    os.makedirs(args.out_dir, exist_ok=True)
    prefix = os.path.join(args.out_dir, f"rl_long_run_{device}")
    say(clock, f"{kind} ({backend}), jax {jax.__version__}; out: {prefix}.*")
    results = {
        "meta": {
            "command": os.environ.get("RL_COMMAND", "")
            or "python benchmarks/rl_long_run.py " + " ".join(sys.argv[1:]),
            "python_command": " ".join(["python", *sys.argv]),
            "device": kind,
            "backend": backend,
            "device_count": jax.device_count(),
            "versions": rl_fine_tuning.versions(),
            "machine": rl_fine_tuning.machine(),
            "budget_s": args.budget,
            "jax_start_s": clock.elapsed(),
            **{
                name: getattr(args, name)
                for name in ("width", "layers", "heads", "prompts", "group")
            },
            "learning_rate": args.learning_rate,
            "args": vars(args),
        },
        "runs": [],
    }

    params, results["pretraining"] = pretrain_within(args, clock)

    order = []
    for seed in args.seeds:
        order += [("bfloat16", seed), ("float16 + lossscale", seed)]
    order.append(("float32", args.seeds[0]))
    calibration = results["calibration"] = {}
    for precision in dict.fromkeys(p for p, _ in order):
        if clock.left() < 30:  # no time to compile it and run it: say so
            calibration[precision] = {"error": "not calibrated: no time left"}
            say(clock, f"{precision}: not calibrated, {clock.left():.0f} s left")
            continue
        try:
            calibration[precision] = calibrate(params, precision, args)
        except Exception:
            calibration[precision] = {"error": traceback.format_exc()}
            say(clock, f"calibration of {precision} failed:\n{traceback.format_exc()}")
            continue
        c = calibration[precision]
        say(
            clock,
            f"{precision}: compiled in {c['compile_s']:.1f} s,"
            f" {1000 * c['per_step_s']:.1f} ms a step",
        )
    order = [(p, s) for p, s in order if "error" not in calibration[p]]
    if not order:
        results["meta"]["wall_s"] = clock.elapsed()
        write(results, prefix)
        return results

    began = time.time()
    write(results, prefix)  # what is known so far; and the time a write takes
    write_s = time.time() - began
    overhead = max(c["overhead_s"] for c in calibration.values() if "error" not in c)
    overhead += write_s + 0.5
    per_step = {p: c["per_step_s"] for p, c in calibration.items() if "error" not in c}
    cycle = sum(per_step[p] for p, _ in order) * (1 + args.margin)
    steps = int((clock.left() - len(order) * overhead) / cycle)
    steps = max(args.min_steps, min(args.max_steps, steps))
    results["meta"].update(steps=steps, write_s=write_s, overhead_s=overhead)
    say(
        clock,
        f"{steps} steps a run: {clock.left():.0f} s left for {len(order)} runs of"
        f" {cycle * steps / len(order):.0f} s on average",
    )

    optional = ("float16, no loss scaling", args.seeds[0])
    f16 = calibration.get("float16 + lossscale", {})
    for precision, seed in [*order, optional]:
        if precision == optional[0]:
            if "error" in f16:
                continue
            # Its own train step compiles (another kind of loss scale); its
            # sampler is float16's, compiled.
            need = f16["compile_s"] + steps * f16["per_step_s"] * (1 + args.margin)
        else:
            need = steps * per_step[precision] * (1 + args.margin)
        need += overhead
        if clock.left() < need:
            results["runs"].append(
                {
                    "precision": precision,
                    "seed": seed,
                    "not_run": f"{need:.0f} s needed, {clock.left():.0f} s left",
                }
            )
            say(clock, f"{precision}, seed {seed}: not run, {need:.0f} s needed")
            write(results, prefix)
            continue
        say(clock, f"{precision}, seed {seed}: {steps} steps")
        try:
            run = one_run(params, precision, seed, steps, args, clock)
        except Exception:
            run = {
                "precision": precision,
                "seed": seed,
                "error": traceback.format_exc(),
            }
            say(clock, f"{precision}, seed {seed} failed:\n{run['error']}")
        else:
            s = run["summary"]
            say(
                clock,
                f"{precision}, seed {seed}: {run['steps']} steps in"
                f" {run['wall_s']:.0f} s{' (cut)' if run['cut'] else ''}; reward"
                f" {s.get('start_reward', float('nan')):.3f} ->"
                f" {s.get('final_reward', float('nan')):.3f}, |dlogp|"
                f" {s.get('dlogp_first', float('nan')):.2e} ->"
                f" {s.get('dlogp_last', float('nan')):.2e}, skipped"
                f" {s.get('skipped')}, scale {s.get('final_scale')}",
            )
        results["runs"].append(run)
        results["meta"]["wall_s"] = clock.elapsed()
        write(results, prefix)
    results["meta"]["wall_s"] = clock.elapsed()
    write(results, prefix)
    say(clock, f"done: {prefix}.{{json,md,png}}")
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
