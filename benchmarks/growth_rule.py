"""Study, not shipped: a growth rule that reads the gradients' headroom.

    python benchmarks/growth_rule.py [--demo-steps 2000] [--lm-steps 300]

Every peer grows the scale blindly (double after 2000 finite steps) and learns the
limit only by overflowing. `HeadroomLossScale`, a kind built on the public extension
point, grows after every finite step as far as the largest scaled gradient allows
(to within `margin_bits` of float16's maximum, in powers of two), and after an
overflow returns to half the scale of the latest finite step. The train step
measures the largest scaled magnitude (NaN-aware) and hands it to the state with
`replace` before `lossscale.update` runs the rule.

Its limit: the final gradients' headroom does not bound the float16 cotangents inside
the backward pass, which can be larger. So this compares it with the TF/Keras rule
(`DynamicLossScale()`) on the demo (deep sigmoid MLP, digits) and on the byte-level
language model, measuring skipped steps, steps spent below the final scale, the
share of gradient elements lost to underflow at the end, the final metric and the
step time. Results: `benchmarks/results/growth_rule.md` (`--out`).
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

import lossscale  # noqa: E402
from lossscale import demo  # noqa: E402
from lossscale import demo_language_model as language_model  # noqa: E402

F16_MAX = 65504.0


class HeadroomLossScale(lossscale.LossScale, kind="benchmarks.headroom"):
    """Grows to the measured headroom, minus a margin; backs off to safety."""

    scale: jax.Array = lossscale.field(dtype=jnp.float32, default=2.0**15)
    # The largest |scaled gradient|, set per step.
    observed: jax.Array = lossscale.field(dtype=jnp.float32, default=0.0)
    # The scale of the latest finite step; the first scale if None.
    safe: jax.Array = lossscale.field(dtype=jnp.float32, default=None)
    margin_bits: int = lossscale.field(static=True, default=4)
    min_scale: float = lossscale.field(static=True, default=1.0)
    max_scale: float = lossscale.field(static=True, default=2.0**24)

    def __post_init__(self):
        if self.safe is None:
            object.__setattr__(self, "safe", self.scale)

    def rule(self, grads_finite):
        tiny = jnp.float32(2.0**-126)
        bits = jnp.floor(jnp.log2(F16_MAX / jnp.maximum(self.observed, tiny)))
        grow = jnp.exp2(jnp.maximum(bits - self.margin_bits, 0.0))
        grown = jnp.minimum(self.scale * grow, self.max_scale)
        backed_off = jnp.maximum(jnp.minimum(self.safe, self.scale) / 2, self.min_scale)
        return self.replace(
            scale=jnp.where(grads_finite, grown, backed_off),
            safe=jnp.where(grads_finite, self.scale, self.safe),
        )


def largest_magnitude(grads):
    """max |g| over the tree, NaN if any element is NaN."""
    leaves = [jnp.max(jnp.abs(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)]
    nan = jnp.any(jnp.stack([jnp.any(jnp.isnan(g)) for g in jax.tree.leaves(grads)]))
    return jnp.where(nan, jnp.nan, jnp.max(jnp.stack(leaves)))


def run(task, rule, steps):
    """Trains `task` with loss-scale `rule`; returns the figures and history."""
    params, loss_fn, next_batch, evaluate, underflow = task(steps)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, 3e-3, max(steps // 20, 1), steps, 3e-5
    )
    tx = optax.adam(schedule)
    opt_state = tx.init(params)
    loss_scale = (
        HeadroomLossScale() if rule == "headroom" else lossscale.DynamicLossScale()
    )

    @jax.jit
    def step(params, opt_state, loss_scale, batch):
        _, grads = lossscale.value_and_grad(loss_fn)(loss_scale, params, *batch)
        if isinstance(loss_scale, HeadroomLossScale):
            loss_scale = loss_scale.replace(observed=largest_magnitude(grads))
        return lossscale.apply_gradients(
            tx, grads=grads, params=params, opt_state=opt_state, loss_scale=loss_scale
        )

    scales, times = [], []
    for _ in range(steps):
        batch = next_batch()
        start = time.perf_counter()
        params, opt_state, loss_scale = step(params, opt_state, loss_scale, batch)
        jax.block_until_ready(loss_scale)
        times.append(time.perf_counter() - start)
        scales.append(float(loss_scale.scale))
    final = scales[-1]
    return {
        "skipped_steps": int(loss_scale.skipped_steps),
        "steps_below_final_scale": int(sum(s < final for s in scales)),
        "final_scale": final,
        "underflow": underflow(params, loss_scale),
        "metric": evaluate(params),
        "step_ms": 1e3 * float(np.median(times[5:])),
    }


def digits_task(steps):
    (x, y), (x_test, y_test) = demo.load_digits(0)
    x, y = jnp.asarray(x), jnp.asarray(y)
    params = demo.init_mlp(jax.random.key(0), demo.SIZES)

    def loss_fn(params, x, y):
        return demo.loss_fn(params, x, y, jnp.float16)

    def evaluate(params):
        logits = demo.logits_fn(params, jnp.asarray(x_test), jnp.float16)
        return float(jnp.mean(jnp.argmax(logits, -1) == y_test))

    def underflow(params, loss_scale):
        return demo.underflow_share(params, jnp.float16, loss_scale, x, y)

    return params, loss_fn, lambda: (x, y), evaluate, underflow


def language_model_task(steps):
    data, held_out = language_model.corpus()
    model = language_model.ByteLM(compute=jnp.float16)
    stream = language_model.batches(data, 64, 128, 0)
    params = model.init(jax.random.key(0), next(stream)[0])["params"]
    held = language_model.batches(held_out, 64, 128, 1)
    held = [next(held) for _ in range(4)]

    def loss_fn(params, x, y):
        return language_model.cross_entropy(model.apply({"params": params}, x), y)

    def evaluate(params):
        return float(np.mean([loss_fn(params, x, y) for x, y in held]))

    def underflow(params, loss_scale):
        x, y = held[0]
        exact = jax.grad(
            lambda p: language_model.cross_entropy(
                language_model.ByteLM().apply({"params": p}, x), y
            )
        )(params)
        _, low = lossscale.value_and_grad(loss_fn)(loss_scale, params, x, y)
        low = lossscale.unscale_grads(low, loss_scale)
        return language_model._fidelity(exact, low)["underflow_share"]

    return params, loss_fn, lambda: next(stream), evaluate, underflow


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo-steps", type=int, default=2000)
    parser.add_argument("--lm-steps", type=int, default=300)
    parser.add_argument("--out", default="benchmarks/results/growth_rule")
    args = parser.parse_args(argv)
    lines = [
        "# Study: a growth rule that reads the headroom, against the TF/Keras rule",
        "",
        f"`python {' '.join(sys.argv)}`: jax {jax.__version__},"
        f" {jax.default_backend()}, seed 0, Adam with warmup and cosine decay,"
        " `apply_gradients`.",
        "",
        "| task | rule | skipped | steps below final scale | final scale |"
        " underflow at end | metric | step ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    tasks = [
        ("digits MLP (test accuracy)", digits_task, args.demo_steps),
        ("byte LM (held-out loss)", language_model_task, args.lm_steps),
    ]
    for name, task, steps in tasks:
        for rule in ("TF/Keras", "headroom"):
            r = run(task, rule, steps)
            lines.append(
                f"| {name}, {steps} steps | {rule} | {r['skipped_steps']} |"
                f" {r['steps_below_final_scale']} | {r['final_scale']:g} |"
                f" {r['underflow']:.4%} | {r['metric']:.4f} | {r['step_ms']:.1f} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    table = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
