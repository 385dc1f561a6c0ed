"""GRPO for hundreds of steps on a GPU: float32, bfloat16, float16 + lossscale.

    OUT=/tmp/rl RL_BUDGET=270 bash benchmarks/gpu_run.sh rl   # the GPU run
    QUICK=1 OUT=/tmp/rl bash benchmarks/gpu_run.sh rl         # a CPU smoke run, 3 min
    python examples/rl_float16/rl_long_run.py --budget 270 \
        --out-dir benchmarks/results/gpu

`examples/rl_float16/rl_float16.py`'s step (its KV-cached sampler and its trainer,
both in the run's dtype; float32 master weights; the clipped GRPO objective;
`lossscale.apply_gradients`) on a larger model, pretrained here in float32 on
`pydoc_data.topics`, for as many steps as a wall-clock budget allows, on the task
`--task` (default `lipogram-words`: each distinct documentation word without an e
scores 1, each word with one -1/2; `rl_float16.words_reward`). The first GPU run
used the binary lipogram, which a continuation of spaces wins: every run had
found it by step 50 of 835, and from there every group's rewards were equal and
nothing trained (`benchmarks/results/rl_long_run_h200_run1.md`).

The runs, in this order, each written out as soon as it ends: bfloat16 and float16
+ lossscale, seeds 0 and 1 (bfloat16 0, float16 0, bfloat16 1, float16 1); float32,
seed 0; float16 without loss scaling, if time is left. Every run starts from the
same pretrained parameters and is planned for the same number of steps. Per step:
the mean reward, the mismatch (mean |log p_trainer - log p_sampler| of the sampled
bytes, the largest importance ratio p_trainer / p_sampler), the global norm of the
unscaled gradients, the skipped steps, the loss scale, the share of groups whose
rewards are all equal (no signal) and the sampler's entropy. Results:
`rl_long_run_<device>.{json,md,png}` in `--out-dir`, rewritten after each run (the
.md is written to be pasted into `docs/guides/rl_float16.md`).

Time. The budget (`--budget` seconds, default `$RL_BUDGET` or 270) counts from
`--start-time` (the shell's start, so that JAX's start counts) to the end, less
`--reserve` (15 s) for the last write; it is spent as:

1. pretraining: the model initialised on the host's CPU (Flax's init is one more
   forward pass to compile and autotune on a GPU), its step's compile, then
   `--pretrain-seconds` (12) of steps and a held-out loss at the step's shapes;
2. calibration: per required dtype, a run of `--calibration-steps` (20; seed 1000,
   thrown away) through the runs' own code, which compiles its sampler and train
   step and times the steps after them;
3. the plan: the steps of every run are the time left, less each run's measured
   overhead (its record's transfer and a write) and `--first-run-allowance` (5 s,
   the first run's few small compiles for its step count's shapes), divided by the
   sum over the required runs of their time per step, times 1 + `--margin` (0.6:
   the first GPU run's runs took 1.2 to 1.6 times the calibration's time per step,
   wall time over steps, for reasons not found); at most `--max-steps`;
4. the runs: each required run keeps the time the later required runs were
   planned to need, so float32, last, gets its share: a run that reaches its own
   deadline (checked every 16 steps) stops there, keeps its steps and is marked
   cut; one that would get less than `--min-fraction` (a quarter) of its planned
   time does not start. Unscaled float16 runs only if its compile (estimated as
   float16 + lossscale's) and all its steps fit. The comparisons with float32 are
   over the steps that all the compared runs ran.

Sizing, from the first GPU run (NVIDIA H200, jax 0.11.2, a budget of 330 s;
`rl_long_run_h200_run1.md`). The model is the H200 language model's: 8 blocks of
width 512, 8 heads, 25.4M parameters. JAX started in 5 s; 16 s went before the
pretraining step began compiling (Flax's init on the GPU, the optimizer's state
leaf by leaf); the step compiled in 19 s and ran 20.5 ms a step (128 x 128 bytes);
25 s of it (1,225 steps, 20M bytes: about 48 passes over the 0.42 MB of text)
gave a train loss of 0.15 and a held-out loss of 2.04 nats/byte: the model had
learned the text by heart. The calibrations (compile and 12 steps) took 30.5 s
(bfloat16, 16.1 ms a step), 26.3 s (float16 + lossscale, 18.5 ms) and 76.4 s
(float32, 32.1 ms). float32 ran its dots at `highest` around the whole loop then,
so every small eager operation of the loop compiled a second time (the precision
is part of every jit's cache key); now only the sampler and the train step are
traced at `highest` (`rl_float16.fine_tune(matmul_precision=...)`). Compiled for
an H100 without one (jaxlib 0.10.2, no autotuning, a loaded 2-core CPU), float32's
train step at `highest` takes 57 s to bfloat16's 46 s, so float32 stays the
longest compile. At 270 s, if the compiles take what they took less float32's
second compiles of the loop's small operations (about 0.15 s each on the H200, some
40 of them), the plan starts at about 175 s and has about 80 s: less 5 runs'
overhead (3 s each) and the first run's 5 s, about 60 s for the steps, a cycle of
the five runs' steps being 101 ms, times 1.6: about 380 steps a run, the runs ending
at 215 to 255 s (at the calibration's pace, or 1.6 times it). The programs' XLA:GPU
tiling needs the trainer's forward
to run all 48 positions (16 + 32; 47 rows found no GEMM tiles when compiled for an
H100): the example does so and drops the last position's logits.

float32 matmuls. XLA on an H100/H200 computes float32 dots in TF32 by default (10
mantissa bits, float16's), which would give the float32 run a float16-sized
mismatch: the float32 run's sampler and trainer trace their dots at `highest`
(true float32). The 16-bit runs keep the default: their one float32 dot, the
output projection, rounds the same 16-bit activations and float32 embedding in
the sampler and the trainer alike. The pretraining keeps the default too.

`--quick`: the example's model (2 blocks of 64, 4 heads), 5 s of pretraining at
32 x 128 bytes, calibration over 6 steps, a budget of 180 s: on a 2-core CPU, the
whole path end to end (runs of a few steps, or none on a loaded machine: then
`--budget 300`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tarfile
import time
import traceback

PROCESS_START = time.time()  # before JAX's import: its start counts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
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
# Per step, from the batch (`batch_stats`): the share of groups whose rewards are all
# equal (GRPO's advantages 0: no signal), and the sampler's entropy.
STATS = ("flat_groups", "entropy")
CHECK_EVERY = 16  # steps between the deadline's checks (each waits for the device)
FLOAT32_DOTS = "highest"  # the float32 run's `jax_default_matmul_precision`


class Clock:
    """Seconds since the start and to the deadline (`budget - reserve` after it)."""

    def __init__(self, start: float, budget: float, reserve: float):
        self.start = start
        self.deadline = start + budget - reserve

    def elapsed(self) -> float:
        """Seconds since the start."""
        return time.time() - self.start

    def left(self) -> float:
        """Seconds to the deadline (negative past it)."""
        return self.deadline - time.time()


def say(clock: Clock, message: str) -> None:
    """Prints `message` to stderr with the seconds since the start."""
    print(f"[{clock.elapsed():5.0f} s] {message}", file=sys.stderr, flush=True)


# 1. Pretraining, for a fixed time.


def initialise(model, batch) -> dict:
    """The model's initial parameters, made on the host's CPU if JAX has one.

    Flax's `init` runs the forward pass: on a GPU that is one more program to
    compile and autotune (the first run spent 16 s before its pretraining step
    began compiling). The random bits are threefry's on any device. One row of
    `batch` is enough: the parameters' shapes do not depend on the batch.
    """
    batch = batch[:1]
    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:
        cpu = None
    if cpu is None or jax.default_backend() == "cpu":
        return jax.jit(model.init)(jax.random.key(0), batch)["params"]
    with jax.default_device(cpu):
        params = jax.jit(model.init)(jax.random.key(0), jax.device_put(batch, cpu))
    return jax.device_put(params["params"], jax.devices()[0])


def pretrain_within(args, clock: Clock) -> tuple[dict, dict]:
    """float32 pretraining for `args.pretrain_seconds` after its compile.

    `lossscale/demo_language_model.py`'s model, batches and loss; Adam with warmup and
    a cosine decay over `args.pretrain_max_steps` (the time may end it first),
    clipped at norm 1. Returns the parameters and a record.
    """
    begin = time.time()
    data, held_out = language_model.corpus()
    model = language_model.ByteLM(
        width=args.width, layers=args.layers, heads=args.heads
    )
    stream = language_model.batches(data, args.pretrain_batch, 128, seed=0)
    params = initialise(model, next(stream)[0])
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        args.pretrain_learning_rate,
        min(100, args.pretrain_max_steps // 10),
        args.pretrain_max_steps,
        args.pretrain_learning_rate / 10,
    )
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))
    opt_state = jax.jit(tx.init)(params)  # one program, not one per leaf's shape
    jax.block_until_ready(opt_state)
    setup = time.time() - begin
    say(clock, f"model initialised in {setup:.1f} s")

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
    trained = time.time()
    seconds = trained - compiled
    losses = [float(x) for x in jax.device_get(losses)]
    # The training batch's shape: the GPU's autotuning of its dots is done.
    evaluate = jax.jit(loss_fn)
    held = language_model.batches(held_out, args.pretrain_batch, 128, seed=1)
    held_loss = float(np.mean([evaluate(params, *next(held)) for _ in range(2)]))
    record = {
        "setup_s": setup,
        "eval_s": time.time() - trained,
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
        task=args.task,
        matmul_precision=FLOAT32_DOTS if compute == rl.F32 else None,
    )


@functools.partial(jax.jit, static_argnums=2)
def batch_stats(rewards, sampler_lp, group: int):
    """A batch's share of groups with equal rewards, and the sampler's entropy.

    The entropy: nats per sampled byte, of the sampler's next-byte distribution,
    averaged over the batch's positions.
    """
    grouped = rewards.reshape(-1, group)
    flat = (grouped == grouped[:, :1]).all(-1).mean()
    p = jnp.exp(sampler_lp)
    entropy = -jnp.where(p > 0, p * sampler_lp, 0.0).sum(-1).mean()
    return flat, entropy


def calibrate(params, precision, args) -> dict:
    """Compiles `precision`'s programs; times the steps after them.

    A run of `args.calibration_steps` (seed 1000, thrown away) through `one_run`:
    the steps, the samples, the statistics and the waits of a real run.
    """
    first, last = 2, args.calibration_steps - 1
    marks = {}
    begin = time.time()
    one_run(params, precision, 1000, args.calibration_steps, args, float("inf"), marks)
    end = time.time()
    per_step = (marks[last] - marks[first]) / (last - first)
    return {
        "compile_s": marks[first] - begin,  # with its first 2 steps
        "per_step_s": per_step,
        # What a run costs beyond its steps: the record's transfer at the end.
        "overhead_s": max(0.0, end - marks[last] - per_step),
        "wall_s": end - begin,
    }


def texts(batch, group: int) -> dict:
    """Three of a batch's samples as text, with rewards; how many continuations differ.

    The three are of different prompts.
    """
    tokens, rewards = jax.device_get((batch[0], batch[3]))
    rows = [0, group, 2 * group][: max(1, tokens.shape[0] // group)]
    return {
        "distinct": len({bytes(row[16:].tolist()) for row in tokens}),
        "of": int(tokens.shape[0]),
        "samples": [
            {
                "prompt": printable(tokens[row, :16]),
                "continuation": printable(tokens[row, 16:]),
                "reward": float(rewards[row]),
            }
            for row in rows
        ],
    }


def printable(tokens) -> str:
    """Bytes as text for a Markdown line: control bytes and invalid UTF-8 escaped."""
    text = bytes(np.asarray(tokens).tolist()).decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def one_run(params, precision, seed, steps, args, deadline, marks=None) -> dict:
    """One RL run of `steps`, cut at `deadline` (`time.time()`); its record.

    `marks`, if given, gets the time at steps 2 and `steps - 1` (the calibration).
    """
    samples, cut, stats = {}, [], []

    def on_step(step, params, batch, loss_scale):
        stats.append(batch_stats(batch[3], batch[1], args.group))
        if step in (0, steps - 1):
            samples["first" if step == 0 else "last"] = texts(batch, args.group)
        if marks is not None and step in (2, steps - 1):
            jax.block_until_ready(params)
            marks[step] = time.time()
        if step and step % CHECK_EVERY == 0:
            jax.block_until_ready(params)
            if time.time() > deadline:
                cut.append(step)
                return True
        return False

    begin = time.time()
    run = fine_tune(params, precision, seed, steps, args, on_step)
    columns = {
        name: [r if key is None else r[key] for r in run[source]]
        for name, (source, key) in COLUMNS.items()
    }
    done = len(columns["reward"])
    stats = np.asarray(jax.device_get(stats[:done]), np.float64).reshape(-1, 2)
    columns.update({name: stats[:, k].tolist() for k, name in enumerate(STATS)})
    wall = time.time() - begin
    return {
        "precision": precision,
        "seed": seed,
        "planned_steps": steps,
        "steps": done,
        "cut": bool(cut),
        "wall_s": wall,
        "ms_per_step": 1000 * wall / max(1, done),
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
        **{f"{name}_tenths": per_tenth(name) for name in STATS if name in columns},
    }


def truncated(run: dict, steps: int) -> dict:
    """`run`'s summary over its first `steps` steps."""
    return summarise({name: v[:steps] for name, v in run["per_step"].items()})


# The plan.


def plan(left: float, per_step: dict, order: list, overhead: float, args):
    """The steps of every run, and the seconds each precision's run is given.

    `left`: seconds to the deadline; `per_step`: the calibration's seconds per
    step of each precision; `order`: the required runs, `(precision, seed)`;
    `overhead`: a run's seconds beyond its steps. A run is given its steps at the
    calibration's pace times 1 + `args.margin`, and its overhead; the required
    runs' time and `args.first_run_allowance` fill `left`.
    """
    margin = 1 + args.margin
    cycle = sum(per_step[p] for p, _ in order) * margin
    spare = left - len(order) * overhead - args.first_run_allowance
    steps = max(args.min_steps, min(args.max_steps, int(spare / cycle)))
    need = {p: steps * t * margin + overhead for p, t in per_step.items()}
    return steps, need


def deadline_of(k: int, order: list, need: dict, deadline: float) -> float:
    """When the `k`-th required run must end: the later ones' time is theirs.

    A run that overruns its share is cut there rather than take the time of
    float32, the last, or of another seed.
    """
    return deadline - sum(need[p] for p, _ in order[k + 1 :])


# Against float32.


def comparisons(runs: list[dict]) -> list[str]:
    """Each precision's reward against float32's, and its mismatch over the run.

    Over the steps that float32 and all of a precision's seeds ran: all of them,
    unless a run was cut at the deadline.
    """
    done = [r for r in runs if r.get("summary")]
    reference = [r for r in done if r["precision"] == "float32"]
    if not reference:
        return ["No float32 run: no comparison."]
    ref_run = reference[0]
    ref = ref_run["summary"]
    low = ref["final_reward"] - 2 * ref["final_reward_se"]
    high = ref["final_reward"] + 2 * ref["final_reward_se"]
    lines = [
        f"float32 (seed {ref_run['seed']}) ends at {ref['final_reward']:.3f} after"
        f" {ref_run['steps']} steps{' (cut)' if ref_run['cut'] else ''} (the mean of"
        " its last tenth; its range, plus or minus 2 standard errors of that mean:"
        f" {low:.3f} to {high:.3f}). Mean |Δ log p| {ref['dlogp_first']:.2e} in the"
        f" first tenth, {ref['dlogp_last']:.2e} in the last.",
    ]
    for precision in ("float16 + lossscale", "bfloat16", "float16, no loss scaling"):
        mine = [r for r in done if r["precision"] == precision]
        if not mine:
            continue
        steps = min(r["steps"] for r in [ref_run, *mine])
        over = ""
        if any(r["steps"] != steps for r in [ref_run, *mine]):
            over = f" (over the first {steps} steps, which every run of the two ran)"
        ref = truncated(ref_run, steps)
        summaries = [truncated(r, steps) for r in mine]
        low = ref["final_reward"] - 2 * ref["final_reward_se"]
        high = ref["final_reward"] + 2 * ref["final_reward_se"]
        finals = [s["final_reward"] for s in summaries]
        final = float(np.mean(finals))
        where = "within" if low <= final <= high else "outside"
        seeds = ", ".join(f"{f:.3f}" for f in finals)
        first = np.mean([s["dlogp_first"] for s in summaries])
        last = np.mean([s["dlogp_last"] for s in summaries])
        lines.append(
            f"{precision}{over}: ends at {final:.3f} (seeds: {seeds}), {where}"
            f" float32's range ({low:.3f} to {high:.3f});"
            f" {departure(ref, summaries, steps)} Mean |Δ log p| {first:.2e} in"
            f" the first tenth, {last:.2e} in the last."
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


def write(results: dict, prefix: str, figure: bool = True) -> None:
    """Writes the .json, the .md and (if `figure`) the .png.

    Packs them if `$PACK` names a file. The figure takes a second or two.
    """
    with open(prefix + ".json", "w") as f:
        json.dump(results, f)
    with open(prefix + ".md", "w") as f:
        f.write(markdown(results))
    if figure:
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
    """The results as the Markdown report the run writes."""
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
            "Model: `lossscale/demo_language_model.py`'s ByteLM,"
            f" {meta['layers']} blocks of width {meta['width']}, {meta['heads']} heads,"
            f" {pre['parameters'] / 1e6:.1f}M parameters, float32 master weights."
            f" Initialised in {pre.get('setup_s', float('nan')):.0f} s, then"
            f" pretrained in float32 for {pre['steps']} steps ({pre['steps_s']:.0f} s"
            f" after a {pre['compile_s']:.0f} s compile) of {pre['batch']} x 128 bytes"
            f" of `pydoc_data.topics`, Adam {pre['learning_rate']:g}: train loss"
            f" {pre['train_loss_last_50']:.3f}, held-out {pre['held_out_loss']:.3f}"
            " nats/byte.",
            "",
        ]
    task = meta.get("task", "lipogram")
    lines += [
        f"RL: `examples/rl_float16/rl_float16.py`'s task `{task}` (32 bytes after a"
        f" 16-byte prompt; reward: {rl.TASKS[task]}), "
        f"{meta['prompts']} prompts x {meta['group']} samples a step, one Adam"
        f" {meta['learning_rate']:g} update (clipped at norm 1) of the clipped GRPO"
        " objective; the sampler (prefill, then decode with a KV cache) and the"
        " trainer in the run's dtype; float32 matmuls in float32"
        " (`jax_default_matmul_precision=highest`, not TF32). float16 + lossscale:"
        " a dynamic scale from 2**15. Every run starts from the same pretrained"
        f" parameters; {meta.get('steps', '?')} steps each, planned from the"
        f" calibration with a margin of {meta['args']['margin']:.0%} on its time"
        " per step:",
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
        " p_trainer / p_sampler over the run; no signal: the share of the last"
        " tenth's groups whose rewards are all equal (GRPO's advantages 0); ms per"
        " step: the run's wall time over its steps.",
        "",
        "| run | seed | steps | wall s | ms per step | start reward | final reward |"
        " \\|Δ log p\\| first | \\|Δ log p\\| last | max ratio |"
        " grad norm (median) | no signal | skipped | final scale |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
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
        flat = s.get("flat_groups_tenths", [float("nan")])[-1]
        lines.append(
            f"| {r['precision']} | {r['seed']} | {steps} | {r['wall_s']:.0f} |"
            f" {r.get('ms_per_step', float('nan')):.1f} |"
            f" {s['start_reward']:.3f} | {s['final_reward']:.3f} |"
            f" {s['dlogp_first']:.2e} | {s['dlogp_last']:.2e} | {s['max_ratio']:.4f} |"
            f" {s['grad_norm_median']:.3g} | {flat:.2f} | {s['skipped']} |"
            f" {s['final_scale']:g} |"
        )
    done = [r for r in results["runs"] if r.get("summary")]
    for title, key, fmt in (
        ("Mean reward per tenth of the run", "reward_tenths", "{:.3f}"),
        ("Mean \\|Δ log p\\| per tenth", "dlogp_tenths", "{:.2e}"),
        ("Largest p_trainer / p_sampler per tenth", "max_ratio_tenths", "{:.4f}"),
        (
            "Share of groups with equal rewards (no signal) per tenth",
            "flat_groups_tenths",
            "{:.2f}",
        ),
        ("The sampler's entropy (nats per byte) per tenth", "entropy_tenths", "{:.3f}"),
    ):
        have = [r for r in done if key in r["summary"]]
        if not have:
            continue
        tenths = max(len(r["summary"][key]) for r in have)
        lines += [
            "",
            f"{title}:",
            "",
            "| run | seed | " + " | ".join(str(k + 1) for k in range(tenths)) + " |",
            "|---|---|" + "---|" * tenths,
        ]
        for r in have:
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
        "Samples (seed 0; the first and the last step's batch, with how many of"
        " its continuations differ; the continuation after `|`):",
        "",
    ]
    for r in [r for r in results["runs"] if r.get("summary")]:
        if r["seed"] != results["runs"][0]["seed"]:
            continue
        for when, batch in r.get("samples", {}).items():
            lines.append(
                f"- {r['precision']}, {when} step: {batch['distinct']} distinct"
                f" continuations of {batch['of']}"
            )
            for sample in batch["samples"][:2]:
                text = sample["prompt"] + "|" + sample["continuation"]
                text = text.replace("`", "'")
                lines.append(f"  - reward {sample['reward']:g}: `{text}`")
    return "\n".join(lines) + "\n"


def moving_mean(values, window: int) -> np.ndarray:
    """The mean of each `window` consecutive values (the values if fewer)."""
    values = np.asarray(values, np.float64)
    if window <= 1 or len(values) < window:
        return values
    return np.convolve(values, np.ones(window) / window, mode="valid")


def plot(results: dict, path: str) -> None:
    """Plots each precision's reward, mismatch and scale against the step."""
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
        ("flat_groups", "groups with equal rewards (moving mean)", "linear", True),
        ("entropy", "sampler's entropy, nats/byte (moving mean)", "linear", True),
    ]
    figure, axes = plt.subplots(2, 4, figsize=(20, 8))
    runs = [r for r in results["runs"] if r.get("summary")]
    for ax, (name, title, yscale, smooth) in zip(axes.ravel(), panels, strict=True):
        for r in runs:
            if name not in r["per_step"]:
                continue
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
    """The command line's arguments."""
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
        help="seconds from --start-time to the end (default: $RL_BUDGET, else 270;"
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
    add("--pretrain-seconds", type=float, default=None, help="12 (5 with --quick)")
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
    add("--task", default="lipogram-words", choices=rl.TASKS, help="the reward")
    add("--seeds", default="0,1", help="the bfloat16 and float16 runs' seeds")
    add("--calibration-steps", type=int, default=None, help="20 (6 with --quick)")
    add("--min-steps", type=int, default=5, help="even if they do not fit")
    add("--max-steps", type=int, default=2000)
    add(
        "--margin",
        type=float,
        default=0.6,
        help="on the planned steps' time: the first GPU run's runs took 1.2 to"
        " 1.6 times the calibration's time per step",
    )
    add(
        "--first-run-allowance",
        type=float,
        default=None,
        help="seconds kept for what the first run compiles (its step count's"
        " shapes): 5 (2 with --quick)",
    )
    add(
        "--min-fraction",
        type=float,
        default=0.25,
        help="a required run starts if this share of its steps fits (it is cut"
        " at its deadline)",
    )
    add("--quick", action="store_true", help="a CPU smoke run (see the docstring)")
    add("--out-dir", default="benchmarks/results/gpu")
    args = parser.parse_args(argv)
    quick = {
        "budget": (270.0, 180.0),
        "width": (512, 64),
        "layers": (8, 2),
        "heads": (8, 4),
        "pretrain_seconds": (12.0, 5.0),
        "calibration_steps": (20, 6),
        "first_run_allowance": (5.0, 2.0),
        "pretrain_batch": (128, 32),
        "pretrain_learning_rate": (1e-3, 3e-3),
    }
    for name, (full, small) in quick.items():
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick else full)
    args.seeds = [int(s) for s in args.seeds.split(",")]
    return args


def device_name(kind: str) -> str:
    """A GPU's model for a file name.

    "NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" -> "h100" (not "hbm3"),
    "NVIDIA A100-SXM4-80GB" -> "a100".
    """
    words = [w for w in kind.split() if w.upper() != "NVIDIA"]
    model = next((w for w in words if any(c.isdigit() for c in w)), words[-1])
    return model.split("-")[0].lower()


def main(argv=None):
    """Pretrains, runs each precision within the time budget, writes results."""
    args = parse(argv)
    clock = Clock(args.start_time or PROCESS_START, args.budget, args.reserve)
    backend = jax.default_backend()
    kind = jax.devices()[0].device_kind
    device = device_name(kind) if backend == "gpu" else backend
    os.makedirs(args.out_dir, exist_ok=True)
    prefix = os.path.join(args.out_dir, f"rl_long_run_{device}")
    say(clock, f"{kind} ({backend}), jax {jax.__version__}; out: {prefix}.*")
    results = {
        "meta": {
            "command": os.environ.get("RL_COMMAND", "")
            or "python examples/rl_float16/rl_long_run.py " + " ".join(sys.argv[1:]),
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
            "task": args.task,
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
        write(results, prefix, figure=False)
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
    steps, need = plan(clock.left(), per_step, order, overhead, args)
    results["meta"].update(
        steps=steps,
        write_s=write_s,
        overhead_s=overhead,
        planned_s={p: need[p] for p, _ in order},
    )
    say(
        clock,
        f"{steps} steps a run: {clock.left():.0f} s left for {len(order)} runs; "
        + ", ".join(f"{p} {need[p]:.0f} s" for p in dict.fromkeys(p for p, _ in order)),
    )

    optional = ("float16, no loss scaling", args.seeds[0])
    f16 = calibration.get("float16 + lossscale", {})
    for k, (precision, seed) in enumerate([*order, optional]):
        if k < len(order):
            deadline = deadline_of(k, order, need, clock.deadline)
            wanted = need[precision]
            enough = args.min_fraction * wanted
        else:
            if "error" in f16:
                continue
            # Its own train step compiles (another kind of loss scale); its
            # sampler is float16's, compiled.
            deadline = clock.deadline
            wanted = enough = f16["compile_s"] + need["float16 + lossscale"]
        left = deadline - time.time()
        if left < enough:
            results["runs"].append(
                {
                    "precision": precision,
                    "seed": seed,
                    "not_run": f"{wanted:.0f} s needed, {left:.0f} s left",
                }
            )
            say(clock, f"{precision}, seed {seed}: not run, {wanted:.0f} s needed")
            write(results, prefix, figure=False)
            continue
        say(
            clock,
            f"{precision}, seed {seed}: {steps} steps, {left:.0f} s to its deadline",
        )
        try:
            run = one_run(params, precision, seed, steps, args, deadline - overhead)
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
                f" {s.get('skipped')}, scale {s.get('final_scale')},"
                f" {run['ms_per_step']:.1f} ms a step",
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
