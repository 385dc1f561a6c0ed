"""Optimizer step alone: lossscale against plain Adam and the peers, in one process.

    pip install -e ".[bench]"
    python benchmarks/optimizer_step.py [--sizes 1M,10M,50M] [--steps 30]
    python benchmarks/optimizer_step.py --inner clip+adam   # clipping in the chain

Every variant takes the gradients of a scaled loss (float32 or float16 leaves, about
50 leaves) and returns new parameters and state, jit-compiled with donated buffers.
The optimizer is Adam, or with `--inner clip+adam` `optax.clip_by_global_norm(1.0)`
then Adam (Keras: Adam with `global_clipnorm=1.0`), for every variant and the
baseline alike.
Its time is measured interleaved with plain `optax.adam` (the baseline), so the
ratios come from one run on one machine. XLA's `cost_analysis()` and
`memory_analysis()` figures of the compiled step are deterministic. A peer that
fails to import, compile or run is reported as failed, with the reason, not dropped.
Results: a table on stdout, and `benchmarks/results/optimizer_step.{json,md}`.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import peers  # noqa: E402
import report  # noqa: E402

import lossscale  # noqa: E402

LR = 1e-3
SCALE = 2.0**15
INNERS = {
    "adam": lambda: optax.adam(LR),
    "clip+adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(LR)),
}
inner = INNERS["adam"]  # set by --inner


# -- the variants: each returns (step, state); step(params, state, grads) ---------


def plain_adam(params):
    tx = inner()

    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, tx.init(params)


def lossscale_wrap(loss_scale):
    def make(params):
        tx = lossscale.wrap(inner(), loss_scale)

        def step(params, opt_state, grads):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        return step, tx.init(params)

    return make


def lossscale_apply_gradients(params):
    tx = inner()

    def step(params, state, grads):
        opt_state, loss_scale = state
        params, opt_state, loss_scale = lossscale.apply_gradients(
            tx, grads=grads, params=params, opt_state=opt_state, loss_scale=loss_scale
        )
        return params, (opt_state, loss_scale)

    return step, (tx.init(params), lossscale.DynamicLossScale())


def lossscale_wrap_clip_norm(params):
    tx = lossscale.wrap(optax.adam(LR), clip_norm=1.0)

    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, tx.init(params)


def lossscale_apply_gradients_clip_norm(params):
    tx = optax.adam(LR)

    def step(params, state, grads):
        opt_state, loss_scale = state
        params, opt_state, loss_scale = lossscale.apply_gradients(
            tx,
            grads=grads,
            params=params,
            opt_state=opt_state,
            loss_scale=loss_scale,
            clip_norm=1.0,
        )
        return params, (opt_state, loss_scale)

    return step, (tx.init(params), lossscale.DynamicLossScale())


def study_select_instead_of_cond(params):
    # Not shipped on the CPU: the one-call step with the skip as a select over
    # params and optimizer state instead of a cond, on every backend (the form
    # lowered for GPUs and TPUs), to see what XLA:CPU makes of it.
    from lossscale._src.step import finite
    from lossscale._src.step import unscaling

    tx = inner()

    def step(params, state, grads):
        opt_state, loss_scale = state
        values = unscaling.values_to_check(grads, loss_scale, params)
        grads_finite = finite.check(values, loss_scale).grads_finite
        updates, new_opt_state = tx.update(
            unscaling.unscale(grads, loss_scale, params), opt_state, params
        )
        new = (optax.apply_updates(params, updates), new_opt_state)
        params, opt_state = optax.tree_utils.tree_where(
            grads_finite, new, (params, opt_state)
        )
        return params, (opt_state, lossscale.update(loss_scale, grads_finite))

    return step, (tx.init(params), lossscale.DynamicLossScale())


def lossscale_train_state(params):
    # The whole-step path: the update is applied inside the cond, so only the
    # new params and optimizer state cross it.
    import lossscale.flax

    state = lossscale.flax.TrainState.create(apply_fn=None, params=params, tx=inner())

    def step(params, state, grads):
        state = state.replace(params=params).apply_gradients(grads=grads)
        return state.params, state.replace(params=None)

    return step, state.replace(params=None)


def optax_apply_if_finite(params):
    # optax has no loss scaling: unscale by the (static) scale, then skip. The
    # gradients are unscaled into the parameters' dtype, as a user must for
    # 16-bit gradients: unscaled in float16, the update's dtype would differ
    # between the cond's branches, which `apply_if_finite` refuses.
    tx = optax.apply_if_finite(inner(), max_consecutive_errors=10**6)

    def step(params, opt_state, grads):
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype) / SCALE, grads, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, tx.init(params)


def jmp_dynamic(params):
    import jmp

    tx = inner()

    def step(params, state, grads):
        opt_state, loss_scale = state
        return peers.jmp_apply(tx, params, opt_state, loss_scale, grads)

    return step, (tx.init(params), jmp.DynamicLossScale(jnp.float32(SCALE)))


def flax_dynamic_scale(params):
    from flax.training import train_state
    from flax.training.dynamic_scale import DynamicScale

    state = train_state.TrainState.create(apply_fn=None, params=params, tx=inner())

    def step(params, carry, grads):
        # Flax's recipe: DynamicScale.value_and_grad of a loss whose gradient is
        # the given one (a dot product), apply_gradients, then a select over
        # params and optimizer state.
        state, dynamic_scale = carry
        state = state.replace(params=params)

        def loss_fn(p):
            return sum(
                jnp.vdot(a.astype(jnp.float32), jax.lax.stop_gradient(g) / SCALE)
                for a, g in zip(jax.tree.leaves(p), jax.tree.leaves(grads), strict=True)
            )

        dynamic_scale, is_finite, _, new_grads = dynamic_scale.value_and_grad(loss_fn)(
            state.params
        )
        new_state = peers.flax_apply_or_keep(state, is_finite, new_grads)
        return new_state.params, (new_state.replace(params=None), dynamic_scale)

    carry = (
        state.replace(params=None),
        DynamicScale(scale=jnp.float32(SCALE), fin_steps=jnp.int32(0)),
    )
    return step, carry


def keras_loss_scale_optimizer(params):
    clipnorm = 1.0 if inner is INNERS["clip+adam"] else None
    apply, variables = peers.keras_optimizer(
        params, learning_rate=LR, initial_scale=SCALE, clipnorm=clipnorm
    )
    return apply, variables


def mpx_dynamic(params):
    import mpx

    tx = inner()

    def step(params, state, grads):
        # As mpx's filter_value_and_grad + optimizer_update.
        opt_state, scaling = state
        finite = mpx.all_finite(grads)
        scaling = scaling.adjust(finite)
        grads = scaling.unscale(grads)
        params, opt_state = mpx.optimizer_update(params, tx, opt_state, grads, finite)
        return params, (opt_state, scaling)

    scaling = mpx.DynamicLossScaling(
        loss_scaling=jnp.float32(SCALE), min_loss_scaling=jnp.float32(1.0)
    )
    return step, (tx.init(params), scaling)


VARIANTS = {
    "plain optax step (baseline)": plain_adam,
    "lossscale.wrap(tx), dynamic": lossscale_wrap("dynamic"),
    "lossscale.wrap(tx), static": lossscale_wrap(SCALE),
    "lossscale.apply_gradients (one call), dynamic": lossscale_apply_gradients,
    "lossscale.flax.TrainState (whole step), dynamic": lossscale_train_state,
    "study: one call with a select, not a cond": study_select_instead_of_cond,
    "optax.apply_if_finite(tx)": optax_apply_if_finite,
    "jmp DynamicLossScale + select_tree": jmp_dynamic,
    "Flax DynamicScale recipe": flax_dynamic_scale,
    "Keras 3 LossScaleOptimizer (stateless)": keras_loss_scale_optimizer,
    "mpx DynamicLossScaling + optimizer_update": mpx_dynamic,
}


def make_tree(total: int, leaves: int, dtype) -> dict[str, jax.Array]:
    sizes = np.full(leaves, total // leaves)
    keys = jax.random.split(jax.random.key(0), leaves)
    return {
        f"p{i:02d}": (jax.random.normal(key, (int(n),), jnp.float32) * 0.01).astype(
            dtype
        )
        for i, (key, n) in enumerate(zip(keys, sizes, strict=True))
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,10M,50M")
    parser.add_argument("--leaves", type=int, default=50)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--grad-dtypes", default="float32,float16")
    parser.add_argument("--variants", default="", help="comma-separated substrings")
    parser.add_argument("--inner", default="adam", choices=sorted(INNERS))
    parser.add_argument("--out", default=None, help="default: benchmarks/results/...")
    args = parser.parse_args(argv)
    global inner
    inner = INNERS[args.inner]
    suffix = "" if args.inner == "adam" else "_clip"
    out = args.out or os.path.join("benchmarks", "results", "optimizer_step" + suffix)

    variants = dict(VARIANTS)
    if args.inner == "clip+adam":
        # Ours with Adam alone and the clipping done in the check's pass.
        variants["lossscale.wrap(adam, clip_norm=1)"] = lossscale_wrap_clip_norm
        variants["lossscale.apply_gradients(adam, clip_norm=1)"] = (
            lossscale_apply_gradients_clip_norm
        )
    selected = {
        name: make
        for name, make in variants.items()
        if not args.variants
        or name == "plain optax step (baseline)"
        or any(part in name for part in args.variants.split(","))
    }
    rows = []
    for size in args.sizes.split(","):
        total = report.parse_size(size)
        for grad_dtype in args.grad_dtypes.split(","):
            params = make_tree(total, args.leaves, jnp.float32)
            grads = make_tree(total, args.leaves, jnp.dtype(grad_dtype))
            grads = jax.tree.map(lambda g: g * SCALE, grads)  # noqa: B023
            label = f"{size} params, {grad_dtype} grads, {args.inner}"
            rows += report.compare(
                selected,
                params,
                grads,
                steps=args.steps,
                label=label,
                baseline="plain optax step (baseline)",
            )
            report.write(
                rows, out, title=f"Optimizer step alone ({args.inner})", echo=False
            )
    report.write(rows, out, title=f"Optimizer step alone ({args.inner})")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception:  # pragma: no cover - a report beats a stack trace
        traceback.print_exc()
        sys.exit(1)
