"""Writes `checkpoint_0_2/`: an Orbax checkpoint saved by lossscale 0.2.

Run with lossscale 0.2 importable (e.g. a worktree of 990b70f on `PYTHONPATH`):

    PYTHONPATH=<lossscale 0.2> python tests/data/make_checkpoint_0_2.py

It saves, as the 0.2 checkpoint guide does, a `wrap(adam)` run's parameters and
optimizer state (a dynamic scale after 7 steps, 2 of them skipped) and a static
scale's state, each with its `get_config()` as JSON, and
`checkpoint_0_2_expected.json`: every field of both states as 0.2 reads them, for
`tests/test_checkpoints.py`.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp

import lossscale

HERE = os.path.dirname(os.path.abspath(__file__))
FIELDS = {
    "dynamic": ["scale", "counter", "overflows_since_growth"],
    "static": [],
}
COUNTERS = ["skipped_steps", "consecutive_skips", "forward_overflows", "stuck"]


def main():
    if lossscale.__version__ != "0.2.0":
        raise SystemExit(f"needs lossscale 0.2.0, got {lossscale.__version__}")
    dynamic = lossscale.DynamicLossScale(
        initial_scale=2.0**10, growth_interval=3, hysteresis=2
    )
    tx = lossscale.wrap(optax.adam(1e-2), dynamic)
    params = {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3) / 10}
    opt_state = tx.init(params)
    step = jax.jit(tx.update)
    for i in range(7):
        bad = jnp.inf if i in (2, 5) else 1.0
        grads = jax.tree.map(lambda p, b=bad: p * b * 2.0**10, params)
        updates, opt_state = step(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    static = lossscale.StaticLossScale(256)
    for finite in (True, False):
        static = lossscale.update(static, jnp.asarray(finite))
    states = {"dynamic": opt_state.loss_scale, "static": static}

    directory = os.path.join(HERE, "checkpoint_0_2")
    shutil.rmtree(directory, ignore_errors=True)
    with ocp.CheckpointManager(directory) as manager:
        manager.save(
            7,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(
                    {"params": params, "opt_state": opt_state, "static": static}
                ),
                dynamic_config=ocp.args.JsonSave(states["dynamic"].get_config()),
                static_config=ocp.args.JsonSave(static.get_config()),
            ),
        )
        manager.wait_until_finished()
    expected = {
        name: {
            f: jax.device_get(getattr(s, f)).tolist() for f in FIELDS[name] + COUNTERS
        }
        for name, s in states.items()
    }
    expected["params"] = jax.device_get(params["w"]).tolist()
    with open(os.path.join(HERE, "checkpoint_0_2_expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
    print(expected)


if __name__ == "__main__":
    main()
