"""Starting a dynamic scale at `diagnostics.preflight`'s `report.scale`, and its cost.

    python benchmarks/preflight_scale.py                 # everything (15 min, 2 CPUs)
    python benchmarks/preflight_scale.py --only time     # the timing alone
    python benchmarks/preflight_scale.py --only reports  # the guide's two reports

1. Skipped batches: a dynamic scale started at the default (2**15) against one
   started at `report.scale`, on programs whose default start loses batches (the
   digits MLP and the byte-level language model of `lossscale/demo_language_model.py`,
   both with a summed rather than averaged loss) and on the demo
   (`lossscale.demo`), whose default loses none. Same seed, batches and steps.
2. Time: `preflight` on the language model at about 10M parameters (width 512, 3
   blocks, batch 64 x 128 bytes), against one training step's wall time and its
   compile time, in one process (preflight first, cold).
3. Steps: the two scale-dependent train steps that `preflight_step` finds (the
   unscaled loss into `wrap`; `clip_by_global_norm` before `wrap`) and the right
   one, trained on the digits with SGD and with Adam (`--only steps`).

Prints each program's report, and writes `benchmarks/results/preflight_scale.md`
(not with `--only reports`, which prints the reports of the demo and of the
language model as `lossscale/demo_language_model.py` trains it, with their optimizers,
as `docs/guides/preflight.md` shows them).
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

import lossscale
from lossscale import demo
from lossscale import demo_language_model as language_model  # noqa: E402

F16, F32 = jnp.float16, jnp.float32


def digits_summed():
    """The demo's data, a 3-layer MLP computing in float16, the loss summed."""
    (x, y), _ = demo.load_digits(0)
    x, y = jnp.asarray(x), jnp.asarray(y)
    params = demo.init_mlp(jax.random.key(0), (64, 128, 128, 10))

    def loss_fn(params, x, y):
        logits = demo.logits_fn(params, x, F16).astype(F32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()

    return loss_fn, params, lambda step: (x, y)


def language_model_problem(width=64, layers=2, heads=4, batch=64, loss="mean"):
    """`lossscale/demo_language_model.py`'s model and batches (float16 compute)."""
    data, _ = language_model.corpus()
    model = language_model.ByteLM(
        width=width, layers=layers, heads=heads, compute=F16, norms=F32
    )
    stream = language_model.batches(data, batch, 128, 0)
    fixed = [next(stream) for _ in range(200)]
    params = model.init(jax.random.key(0), fixed[0][0])["params"]

    def loss_fn(params, x, y):
        logits = model.apply({"params": params}, x).astype(F32)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return losses.sum() if loss == "sum" else losses.mean()

    return loss_fn, params, lambda step: fixed[step % len(fixed)]


def skipped_batches(loss_fn, params, batch, start, steps, learning_rate):
    """Trains with Adam and a dynamic scale from `start`; returns the skips."""
    tx = optax.adam(learning_rate)

    @jax.jit
    def step(params, opt_state, loss_scale, x, y):
        loss, grads = lossscale.value_and_grad(loss_fn)(loss_scale, params, x, y)
        params, opt_state, loss_scale = lossscale.apply_gradients(
            tx, grads=grads, params=params, opt_state=opt_state, loss_scale=loss_scale
        )
        return params, opt_state, loss_scale, loss

    state = (params, tx.init(params), lossscale.DynamicLossScale(scale=start))
    for index in range(steps):
        *state, loss = step(*state, *batch(index))
    metrics = lossscale.metrics(state[2])
    return int(metrics["skipped_steps"]), float(metrics["loss_scale"]), float(loss)


def compare(name, problem, steps, learning_rate, lines):
    loss_fn, params, batch = problem
    report = lossscale.diagnostics.preflight(loss_fn, params, *batch(0))
    print(f"== {name}\n{report}\n", flush=True)
    row = [name, str(steps)]
    for start in (2.0**15, report.scale):
        skipped, scale, loss = skipped_batches(
            loss_fn, params, batch, start, steps, learning_rate
        )
        row += [f"{start:g}", str(skipped), f"{scale:g}", f"{loss:.4g}"]
    lines.append("| " + " | ".join(row) + " |")
    return report


def compare_demo(lines, steps):
    data = demo.load_digits(0)
    (x, y), _ = data
    params = demo.init_mlp(jax.random.key(0), demo.SIZES)
    report = lossscale.diagnostics.preflight(
        demo.loss_fn, params, jnp.asarray(x), jnp.asarray(y), F16
    )
    print(f"== the demo (python -m lossscale.demo)\n{report}\n", flush=True)
    row = ["the demo (mean loss, 8 sigmoid layers)", str(steps)]
    for start in (2.0**15, report.scale):
        run = demo.train(
            F16, lossscale.DynamicLossScale(scale=start), data, steps=steps, seed=0
        )
        row += [f"{start:g}", str(run["skipped_steps"]), f"{run['loss_scale']:g}"]
        row.append(f"{run['final_loss']:.4g} (test acc {run['accuracy']:.3f})")
    lines.append("| " + " | ".join(row) + " |")


def timing(lines):
    """`preflight` on the ~10M-parameter model, then one training step's cost."""
    loss_fn, params, batch = language_model_problem(width=512, layers=3, heads=8)
    count = sum(p.size for p in jax.tree.leaves(params))
    x, y = batch(0)
    tx = lossscale.wrap(optax.adam(1e-3))
    start = time.perf_counter()
    report = lossscale.diagnostics.preflight(loss_fn, params, x, y, optimizer=tx)
    seconds = time.perf_counter() - start
    print(f"== language model, {count / 1e6:.1f}M parameters\n{report}\n", flush=True)

    def step(params, opt_state, x, y):
        grads = jax.grad(lambda p: lossscale.scale_loss(loss_fn(p, x, y), opt_state))(
            params
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    begin = time.perf_counter()
    compiled = jax.jit(step).lower(params, opt_state, x, y).compile()
    compile_seconds = time.perf_counter() - begin
    times = []
    state = (params, opt_state)
    for index in range(4):
        begin = time.perf_counter()
        state = jax.block_until_ready(compiled(*state, *batch(index)))
        times.append(time.perf_counter() - begin)
    step_seconds = float(np.median(times[1:]))
    budget = 5 * step_seconds + compile_seconds
    lines += [
        f"| {count / 1e6:.1f}M | {seconds:.1f} | {step_seconds:.2f} |"
        f" {compile_seconds:.1f} | {budget:.1f} | {seconds / budget:.2f} |"
    ]
    return report


def trained_steps(lines, steps):
    """Test accuracy after training with each step; and `preflight_step`'s codes."""
    data = demo.load_digits(0)
    (x, y), (x_test, y_test) = data
    x, y = jnp.asarray(x), jnp.asarray(y)
    params = demo.init_mlp(jax.random.key(0), (64, 64, 64, 10))

    def loss_fn(params):
        logits = demo.logits_fn(params, x, F16).astype(F32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def make(kind, inner):
        wrapped = lossscale.wrap(inner, "dynamic")
        tx = optax.chain(optax.clip_by_global_norm(1.0), wrapped)
        if kind != "clip before wrap":
            tx = lossscale.wrap(optax.chain(optax.clip_by_global_norm(1.0), inner))

        def step(state):
            params, opt_state = state
            if kind == "unscaled loss":
                grads = jax.grad(loss_fn)(params)
            else:
                grads = lossscale.value_and_grad(loss_fn)(opt_state, params)[1]
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        return jax.jit(step), (params, tx.init(params))

    for name, inner in (("SGD 0.5", optax.sgd(0.5)), ("Adam 3e-3", optax.adam(3e-3))):
        for kind in ("right", "unscaled loss", "clip before wrap"):
            step, state = make(kind, inner)
            codes = sorted(lossscale.diagnostics.preflight_step(step, state).codes)
            for _ in range(steps):
                state = step(state)
            logits = demo.logits_fn(state[0], jnp.asarray(x_test), F16)
            accuracy = float(jnp.mean(jnp.argmax(logits, -1) == y_test))
            lines.append(f"| {name} | {kind} | {accuracy:.3f} | {codes} |")


def reports():
    """The demo's and the language model's reports, with their optimizers."""
    (x, y), _ = demo.load_digits(0)
    params = demo.init_mlp(jax.random.key(0), demo.SIZES)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 100, 2000, 3e-5)
    for name, loss_scale in (("dynamic", "dynamic"), ("no", None)):
        tx = lossscale.wrap(optax.adam(schedule), loss_scale)  # as `demo.train`
        report = lossscale.diagnostics.preflight(
            demo.loss_fn, params, jnp.asarray(x), jnp.asarray(y), F16, optimizer=tx
        )
        print(f"== python -m lossscale.demo, float16, {name} loss scaling\n{report}\n")
    loss_fn, params, batch = language_model_problem()
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 20, 200, 1e-4)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))
    report = lossscale.diagnostics.preflight(
        loss_fn,
        params,
        *batch(0),
        optimizer=tx,
        loss_scale=lossscale.DynamicLossScale(),  # as `language_model.train`
    )
    print(f"== python -m lossscale.demo_language_model, float16 dynamic\n{report}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", choices=["scale", "time", "steps", "reports"], default=None
    )
    parser.add_argument("--steps", type=int, default=1000, help="of part 3")
    parser.add_argument("--out", default="benchmarks/results/preflight_scale.md")
    args = parser.parse_args(argv)
    if args.only == "reports":
        return reports()
    lines = [
        "# Starting the scale at `report.scale`, and what `preflight` costs",
        "",
        f"`python {' '.join(sys.argv)}`: jax {jax.__version__},"
        f" {jax.default_backend()}, {os.cpu_count()} CPUs.",
    ]
    if args.only in (None, "scale"):
        lines += [
            "",
            "Skipped batches with a dynamic scale started at the default, 2**15, and"
            " at `report.scale`; Adam; the same seed and batches.",
            "",
            "| program | steps | default start | skipped | final scale | final loss"
            " | report.scale | skipped | final scale | final loss |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        compare("digits MLP, summed loss", digits_summed(), 100, 1e-3, lines)
        compare(
            "language model, summed loss",
            language_model_problem(loss="sum"),
            100,
            1e-3,
            lines,
        )
        compare_demo(lines, steps=2000)
    if args.only in (None, "steps"):
        lines += [
            "",
            "Train steps with `wrap` on the digits (2 sigmoid layers of 64, float16"
            f" compute, full batch, {args.steps} steps, clipping at 1), test"
            " accuracy, and what `preflight_step` says of each step before training.",
            "",
            "| optimizer | step | test accuracy | `preflight_step` codes |",
            "|---|---|---|---|",
        ]
        trained_steps(lines, args.steps)
    if args.only in (None, "time"):
        lines += [
            "",
            "`preflight` (with the optimizer, cold: first in the process) against"
            " one training step of the same model (`wrap(adam)`, jitted): the"
            " target is 5 steps plus the step's compile time.",
            "",
            "| parameters | preflight (s) | step (s) | step compile (s) |"
            " 5 x step + compile (s) | ratio |",
            "|---|---|---|---|---|---|",
        ]
        timing(lines)
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
