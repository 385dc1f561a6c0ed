"""Writes `checkpoint_0_3_0/` and `checkpoint_0_3_0.msgpack`: lossscale 0.3.0's.

Run with lossscale 0.3.0 importable (the commit before the state gained
`overflow_scale`, 2ef00ab):

    PYTHONPATH=<lossscale 0.3.0> python tests/data/make_checkpoint_0_3_0.py

It saves, as the 0.3.0 checkpoint guide does, a `wrap(adam)` run's parameters and
optimizer state (a dynamic scale after 7 steps, 2 of them skipped), a static
scale's state, a `lossscale.flax.TrainState` and the state of a
`lossscale.flax.Optimizer` (NNX), with the dynamic scale's `get_config()` as JSON;
the same trees (but the NNX one) with `flax.serialization.to_bytes`; and
`checkpoint_0_3_0_expected.json`: every field of the states as 0.3.0 reads them,
for `tests/test_checkpoints.py`.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from flax import nnx
from flax import serialization

import lossscale
import lossscale.flax

HERE = os.path.dirname(os.path.abspath(__file__))
FIELDS = {
    "dynamic": ["scale", "counter", "overflows_since_growth"],
    "static": [],
    "train_state": ["scale", "counter", "overflows_since_growth"],
    "nnx": ["scale", "counter", "overflows_since_growth"],
}
COUNTERS = [
    "skipped_steps",
    "consecutive_skips",
    "forward_overflows",
    "stuck",
    "overflow_leaf",
]


def trees():
    """The states 0.3.0 saves: a run of each API, with skips."""
    dynamic = lossscale.DynamicLossScale(scale=2.0**10, growth_interval=3, hysteresis=2)
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

    train_state = lossscale.flax.TrainState.create(
        apply_fn=None, params={"w": jnp.ones(3)}, tx=optax.sgd(0.1), loss_scale=dynamic
    )
    for bad in (1.0, jnp.inf, 1.0):
        grads = {"w": jnp.full(3, bad * 2.0**10)}
        train_state = jax.jit(lambda s, g: s.apply_gradients(grads=g))(
            train_state, grads
        )

    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    optimizer = lossscale.flax.Optimizer(
        model, optax.adam(1e-2), wrt=nnx.Param, loss_scale=dynamic
    )

    @nnx.jit
    def nnx_step(model, optimizer, x):
        def loss_fn(model):
            return lossscale.scale_loss(jnp.mean(model(x) ** 2), optimizer)

        optimizer.update(model, nnx.grad(loss_fn)(model))

    for x in (jnp.ones((4, 3)), jnp.full((4, 3), jnp.inf), jnp.ones((4, 3))):
        nnx_step(model, optimizer, x)
    return params, opt_state, static, train_state, optimizer


def main():
    if lossscale.__version__ != "0.3.0" or "overflow_scale" in str(
        lossscale.DynamicLossScale()
    ):
        raise SystemExit("needs lossscale 0.3.0, before `overflow_scale`")
    params, opt_state, static, train_state, optimizer = trees()
    state = {
        "params": params,
        "opt_state": opt_state,
        "static": static,
        "train_state": train_state,
    }
    directory = os.path.join(HERE, "checkpoint_0_3_0")
    shutil.rmtree(directory, ignore_errors=True)
    with ocp.CheckpointManager(directory) as manager:
        manager.save(
            7,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                nnx=ocp.args.StandardSave(nnx.state(optimizer)),
                dynamic_config=ocp.args.JsonSave(opt_state.loss_scale.get_config()),
            ),
        )
        manager.wait_until_finished()
    with open(os.path.join(HERE, "checkpoint_0_3_0.msgpack"), "wb") as f:
        f.write(serialization.to_bytes(state))
    states = {
        "dynamic": opt_state.loss_scale,
        "static": static,
        "train_state": train_state.loss_scale,
        "nnx": optimizer.loss_scale,
    }
    expected = {
        name: {
            f: jax.device_get(getattr(s, f)).tolist() for f in FIELDS[name] + COUNTERS
        }
        for name, s in states.items()
    }
    expected["params"] = jax.device_get(params["w"]).tolist()
    with open(os.path.join(HERE, "checkpoint_0_3_0_expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")
    print(expected)


if __name__ == "__main__":
    main()
