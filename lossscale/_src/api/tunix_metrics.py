"""The loss-scale metrics a tunix trainer logs, at the step they belong to.

`scale_trainer` sets training hooks (`log_metrics_of`) that log `METRICS` through
tunix's metrics logger beside its own loss and gradient norm.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lossscale._src.api import lookup
from lossscale._src.state.kind import LossScale

# What the installed step logs through tunix's metrics logger, per train step.
METRICS = ("loss_scale", "skipped_steps")


def log_metrics_of(trainer: Any) -> None:
    """Sets training hooks that log `METRICS`, around the trainer's own hooks."""
    if not isinstance(trainer.training_hooks, _MetricsHooks):
        trainer.training_hooks = _MetricsHooks(trainer.training_hooks)


class _MetricsHooks:
    """tunix training hooks: the loss-scale metrics, then the given hooks' call.

    tunix writes a step's metrics while the next step runs (`on_train_step_end`
    comes one step late, or at `close` for the last): the state after the step
    it names is copied on the device where the step after it starts, and logged
    then, so the host waits on no step tunix itself does not wait on.
    """

    def __init__(self, inner: Any):
        self.inner = inner
        self.after: dict[int, dict[str, Any]] = {}  # train steps done -> figures

    def __getattr__(self, name: str) -> Any:  # every other hook: the given one's
        return getattr(self.inner, name) if self.inner else lambda *a, **k: None

    def on_train_step_start(self, train_ctx: Any):
        # The first micro-batch's start after `train_steps` steps: their state.
        self.after.setdefault(train_ctx.train_steps, _figures(train_ctx))
        if self.inner is not None:
            self.inner.on_train_step_start(train_ctx)

    def on_train_step_end(self, train_ctx: Any, train_step: int, train_loss: Any):
        figures = self.after.pop(train_step, None) or _figures(train_ctx)
        self.after = {s: f for s, f in self.after.items() if s >= train_step}
        for name in METRICS:
            train_ctx.metrics_logger.log(
                train_ctx.metrics_prefix,
                name,
                np.asarray(figures[name]),
                "train",
                train_step,
            )
        if self.inner is not None:
            self.inner.on_train_step_end(train_ctx, train_step, train_loss)


def _figures(train_ctx: Any) -> dict[str, Any]:
    """The loss-scale metrics of the trainer's optimizer now, as device arrays.

    Copies, on the device: the next step donates the state's own buffers.
    """
    state = state_of(train_ctx.optimizer)
    return {
        "loss_scale": jnp.copy(state.scale),
        "skipped_steps": jnp.copy(state.skipped_steps),
    }


def state_of(optimizer: Any) -> LossScale:
    """The loss-scale state in an `nnx.Optimizer`, as arrays (traced in the step)."""
    state = lookup.find(optimizer, "optimizer")
    return jax.tree.map(
        lambda x: x.get_value() if isinstance(x, nnx.Variable) else x,
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
