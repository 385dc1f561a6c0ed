"""`preflight`: before the first step, why float16 training would fail and the fix.

The checks are in `forward_hazards` (the traced program and its forward pass on
the probe batch), `gradient_hazards` (the scaled gradients at a few scales) and
`optimizer_hazards` (one probe update); the guide, `docs/guides/preflight.md`,
shows each code on a program that has it.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import numpy as np
import optax

from lossscale._src import validation
from lossscale._src.api import lookup
from lossscale._src.diagnostics import forward_hazards
from lossscale._src.diagnostics import gradient_hazards
from lossscale._src.diagnostics import holders
from lossscale._src.diagnostics import optimizer_hazards
from lossscale._src.diagnostics.engine.probe import Probe
from lossscale._src.diagnostics.engine.program import Program
from lossscale._src.diagnostics.engine.program import tracer
from lossscale._src.diagnostics.findings import PreflightReport
from lossscale._src.diagnostics.findings import ordered
from lossscale._src.state import kinds
from lossscale._src.state import spec
from lossscale._src.state.kind import LossScale


def preflight(
    loss_fn: Callable[..., Any],
    params: Any,
    *args: Any,
    optimizer: optax.GradientTransformation | None = None,
    loss_scale: Any = None,
    has_aux: bool = False,
) -> PreflightReport:
    """Says, before the first step, why float16 training will fail, where, and how.

    On the host, outside `jax.jit`: traces `loss_fn(params, *args)` and its
    gradients in the dtypes the code chooses, runs them on the batch at a few
    loss scales with its float16 values measured (one compiled program) and,
    with `optimizer`, one probe update. Each hazard is a `Finding` (codes and
    examples: `docs/guides/preflight.md`); `report.scale` is the highest a
    dynamic scale can start on this batch. It differentiates the floating-point
    arrays of `params` (a tree, a Flax NNX or Equinox model); integer and key arguments
    are passed as they are. Its cost: a compile and a few training steps.

    Args:
      loss_fn: returns a floating-point scalar, or `(loss, aux)` with `has_aux`.
      params: what the step differentiates.
      *args: the rest of `loss_fn`'s arguments: one real batch.
      optimizer: the optax transformation (wrapped or not), for its checks; or
        a `lossscale.flax.Optimizer` (NNX) or `TrainState`, for its `tx` and
        its loss-scale state.
      loss_scale: the starting loss scale: a state, a tree holding one, a
        number or "dynamic"; None: the `optimizer`'s, else `DynamicLossScale()`.
      has_aux: whether `loss_fn` returns `(loss, aux)`.

    Returns:
      A `PreflightReport`; `print(report)` shows a table.

    Raises:
      TypeError: for a bad argument type, or a traced argument (under `jit`).
      ValueError: if `params` has no floating-point array, or `loss_scale` is
        out of range or holds no (or several) loss-scale states.

    Examples:
      >>> import jax.numpy as jnp, lossscale
      >>> def loss_fn(w, x):  # float16 compute, and the loss too
      ...     return jnp.mean((x.astype(jnp.float16) @ w.astype(jnp.float16)) ** 2)
      >>> report = lossscale.diagnostics.preflight(
      ...     loss_fn, jnp.ones((4, 2)), jnp.ones((8, 4)))
      >>> print(sorted(report.codes), report.scale)
      ['gradient-overflow', 'loss-in-half'] 4096.0
    """
    problem = Program.build(
        loss_fn, params, args, {}, has_aux, "preflight(loss_fn, params, x, y)"
    )
    leaf = tracer(params, args, loss_scale)
    if leaf is not None:
        raise TypeError(
            "`preflight` runs on the host, on concrete arrays: it runs the"
            " program on them and reads the values back. It was given a traced"
            f" value ({leaf!r}); call it outside `jax.jit`, `jax.grad` and other"
            " transformations, once, before training."
        )
    if _holds_a_transformation(optimizer):
        # An NNX optimizer or a train state: its `tx`, from its own loss scale.
        if loss_scale is None and lookup.find_all(optimizer):
            loss_scale = holders.values(lookup.find(optimizer, "optimizer"))
        optimizer = typing.cast(Any, optimizer).tx
    if optimizer is not None:
        validation.validate_transformation(optimizer, "optimizer")
    start = _start(loss_scale, optimizer, problem)
    probe = Probe(problem)
    first = probe(float(start.scale))
    findings, scale, notes = forward_hazards.check(problem, probe, first), None, []
    if not np.isfinite(first.loss):
        notes.append("Gradients not probed: the loss is not finite on this batch.")
    else:
        gradients = gradient_hazards.check(problem, probe, start)
        findings += gradients.findings
        scale = gradients.scale
        notes.append(gradients.note)
        if optimizer is None:
            notes.append(
                "No `optimizer` given: optimizer-underflow and update-underflow"
                " were not checked."
            )
        elif gradients.reference is None:
            notes.append("No finite gradients: the optimizer was not probed.")
        else:
            findings += optimizer_hazards.check(problem, optimizer, gradients.reference)
    return PreflightReport(ordered(findings), scale, tuple(notes))


def _holds_a_transformation(optimizer: Any) -> bool:
    """Whether `optimizer` is an `nnx.Optimizer` or a train state, with a `tx`."""
    return (
        not isinstance(optimizer, optax.GradientTransformation)
        and isinstance(getattr(optimizer, "tx", None), optax.GradientTransformation)
        and hasattr(optimizer, "opt_state")
    )


def _start(loss_scale: Any, optimizer: Any, problem: Program) -> LossScale:
    """The loss-scale state the first step would use."""
    if loss_scale is None:
        if optimizer is not None:
            state = optimizer.init(problem.masked_params(problem.diff))
            if lookup.find_all(state):  # several: the error says which
                return lookup.find(state, "optimizer.init(params)")
        return kinds.DynamicLossScale()
    if isinstance(loss_scale, LossScale | str) or validation.is_number(loss_scale):
        return spec.from_spec(loss_scale, "loss_scale")
    return lookup.find(loss_scale, "loss_scale")
