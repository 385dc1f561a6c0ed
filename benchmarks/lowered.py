"""The step lowered for XLA:CPU, CUDA and TPU, hashed: a refactor keeps the program.

Lowering needs no device: `jit(f).trace(...).lower(lowering_platforms=(p,))` gives the
StableHLO each backend compiles. The same text (source locations stripped) means the
same compiled program, so the same kernels, bytes and temp as `compiled.py` measured.
Run it on two checkouts and compare:

    PYTHONPATH=. python benchmarks/lowered.py
"""

import hashlib
import re

import jax
import jax.numpy as jnp
import optax

import lossscale

# Leaves of both kinds the check tells apart: large (reduced alone) and small (stacked).
PARAMS = {
    f"w{i}": jnp.ones((64, 16) if i % 2 else (4096,), jnp.float32) for i in range(12)
}
GRADS = jax.tree.map(lambda p: p.astype(jnp.float16), PARAMS)
TX = optax.adam(1e-3)
WRAPPED = lossscale.wrap(optax.adam(1e-3))


def one_call(params, opt_state, loss_scale, grads):
    return lossscale.apply_gradients(
        TX, grads=grads, params=params, opt_state=opt_state, loss_scale=loss_scale
    )


def wrapped(params, opt_state, grads):
    updates, opt_state = WRAPPED.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def main():
    steps = {
        "apply_gradients": (
            one_call,
            (PARAMS, TX.init(PARAMS), lossscale.DynamicLossScale(), GRADS),
        ),
        "wrap": (wrapped, (PARAMS, WRAPPED.init(PARAMS), GRADS)),
    }
    for name, (step, args) in steps.items():
        traced = jax.jit(step).trace(*args)
        for platform in ("cpu", "cuda", "tpu"):
            text = traced.lower(lowering_platforms=(platform,)).as_text()
            text = re.sub(r"loc\(.*?\)|#loc\d*( = .*)?", "", text)
            digest = hashlib.sha256(text.encode()).hexdigest()[:16]
            print(f"{name:16} {platform:5} {digest} {len(text)} characters")


if __name__ == "__main__":
    main()
