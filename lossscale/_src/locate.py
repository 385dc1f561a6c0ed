"""Saying where an overflow happened: the gradient leaf, the op and its line."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale._src import checks
from lossscale._src import functional
from lossscale._src import interpret
from lossscale._src import kinds
from lossscale._src import lookup
from lossscale._src import program


def leaf_path(params: Any, index: Any) -> str | None:
    """The path of leaf `index` of `params`, as `jax.tree_util.keystr` writes it.

    Names the leaf that `lossscale.metrics(opt_state)["overflow_leaf"]` points
    at. Run it on the host, after the step: it reads `index`'s value.

    Args:
      params: the parameters (or any tree with their structure: the gradients,
        a Flax variables dict, an Equinox model).
      index: an int, or an int32 scalar array such as `metrics(...)
        ["overflow_leaf"]`; -1 (no overflow yet) gives None.

    Returns:
      The path (e.g. `"['dense']['kernel']"`), or None for -1.

    Raises:
      TypeError: if `index` is not an integer scalar.
      ValueError: if `index` is below -1 or past the last leaf.

    Examples:
      >>> import jax.numpy as jnp, lossscale
      >>> params = {"dense": {"bias": jnp.zeros(2), "kernel": jnp.ones((3, 2))}}
      >>> print(lossscale.leaf_path(params, 1))
      ['dense']['kernel']
      >>> print(lossscale.leaf_path(params, -1))
      None
    """
    value = np.asarray(index)
    if value.shape != () or not (
        np.issubdtype(value.dtype, np.integer) or isinstance(index, numbers.Integral)
    ):
        raise TypeError(
            "`index` must be an integer scalar (e.g. `metrics(opt_state)"
            f'["overflow_leaf"]`), got {index!r}.'
        )
    paths, _, _ = program.flatten_with_paths(params)
    position = int(value)
    if position == -1:
        return None
    if not 0 <= position < len(paths):
        raise ValueError(
            f"`index` is {position}, but `params` has {len(paths)} leaves: it must be"
            f" -1 (no overflow yet) or in [0, {len(paths)}). Pass the tree whose"
            " gradients the step checked."
        )
    return paths[position]


@dataclasses.dataclass(frozen=True)
class OverflowReport:
    """Where a step overflowed, from `lossscale.locate_overflow`.

    Attributes:
      kind: "forward" (the loss is not finite: no scale fixes it), "backward"
        (the loss is finite, some gradients are not) or None (all finite).
      leaves: the paths (`jax.tree_util.keystr`) of the parameters whose
        unscaled gradients are not finite, in `jax.tree.leaves` order.
      op: the name of the first primitive that produced a non-finite value from
        finite inputs, in the forward or the backward pass; None if none did.
      source: `"file:line"` of the user's code that called that op.
      function: the function that line is in.
      backward_pass: whether that op is in the backward pass.
      scale: the loss scale the step was evaluated at.
      loss: the unscaled loss, as a Python float.

    Examples:
      >>> import jax.numpy as jnp, lossscale
      >>> report = lossscale.locate_overflow(
      ...     lambda w: jnp.sum(w**2), jnp.ones(2), loss_scale=1024.0)
      >>> print(report)
      No overflow at loss scale 1024: the loss (2) and every gradient are finite.
    """

    kind: str | None
    leaves: tuple[str, ...]
    op: str | None
    source: str | None
    function: str | None
    backward_pass: bool
    scale: float
    loss: float

    def __str__(self) -> str:
        if self.kind is None:
            return (
                f"No overflow at loss scale {self.scale:g}: the loss ({self.loss:g})"
                " and every gradient are finite."
            )
        where = ""
        if self.op is not None:
            place = self.source or "an unknown line"
            if self.function:
                place += f" (in {self.function})"
            step = "backward" if self.backward_pass else "forward"
            where = (
                f" The first non-finite value came from `{self.op}` at {place},"
                f" in the {step} pass."
            )
        named = ", ".join(self.leaves[:3]) + (
            f" and {len(self.leaves) - 3} more" if len(self.leaves) > 3 else ""
        )
        grads = f" Non-finite gradients: {named}." if self.leaves else ""
        if self.kind == "forward":
            return (
                f"Forward overflow at loss scale {self.scale:g}: the loss is"
                f" {self.loss:g}.{where}{grads} No loss scale fixes a forward"
                " overflow: compute that op in float32 (cast its input with"
                " `.astype(jnp.float32)`), or keep its input within float16's range"
                " (e.g. subtract the max before `exp`, as `jax.nn.softmax` does)."
            )
        return (
            f"Backward overflow at loss scale {self.scale:g}: the loss"
            f" ({self.loss:g}) is finite.{grads}{where} A lower scale avoids it"
            " (a dynamic scale backs off by itself); if it overflows at low scales"
            " too, compute that op in float32."
        )


def locate_overflow(
    loss_fn: Callable[..., Any],
    params: Any,
    *args: Any,
    loss_scale: Any,
    has_aux: bool = False,
    **kwargs: Any,
) -> OverflowReport:
    """Finds where a step overflows: the gradient leaves, the op and its line.

    Runs `jax.value_and_grad` of `scale_loss(loss_fn(params, *args, **kwargs),
    loss_scale)` one primitive at a time, on the host, checking what each one
    produces. It differentiates the floating-point array leaves of `params`
    (others, such as an Equinox model's functions, are held fixed). Call it on
    the failing batch, outside the train step; it syncs after every op, so it
    is slow (seconds for a small model, minutes for a large one). `loss_fn`
    may be jitted: the walk goes into `jax.jit`, `jax.checkpoint` and custom
    derivative rules; other control flow (`lax.cond`, `scan`) is named whole.

    Args:
      loss_fn: the loss function, as the step calls it: it returns a
        floating-point scalar, or `(loss, aux)` with `has_aux`.
      params: what the step differentiates: a tree of parameters, a Flax NNX
        or Equinox model.
      *args: `loss_fn`'s further arguments (the batch).
      loss_scale: the scale to evaluate at: a loss-scale state, a tree holding
        one (the optimizer state), or a positive number.
      has_aux: whether `loss_fn` returns `(loss, aux)`.
      **kwargs: `loss_fn`'s keyword arguments.

    Returns:
      An `OverflowReport`; `str(report)` says what to do.

    Raises:
      TypeError: if `loss_fn` is not callable, `has_aux` is not a bool,
        `loss_scale` is none of the above, or `loss_fn` does not return a
        floating-point scalar.
      ValueError: if `loss_scale` is a number that is not positive and finite,
        or `params` has no floating-point array to differentiate.

    Examples:
      >>> import jax.numpy as jnp, lossscale
      >>> def loss_fn(params, x):
      ...     h = jnp.exp(x.astype(jnp.float16) * params["w"].astype(jnp.float16))
      ...     return jnp.sum(h.astype(jnp.float32))
      >>> report = lossscale.locate_overflow(
      ...     loss_fn, {"w": jnp.ones(2)}, jnp.array([1.0, 20.0]), loss_scale=1024.0)
      >>> print(report.kind, report.op, report.leaves)
      forward exp ("['w']",)
    """
    problem = program.Program.build(loss_fn, params, args, kwargs, has_aux)
    state = _state(loss_scale)

    def scaled(diff, batch):
        loss, _ = problem.loss(diff, batch)
        return functional.scale_loss(loss, state), loss

    def step(diff, batch):
        return jax.value_and_grad(scaled, has_aux=True)(diff, batch)

    diff, batch = problem.diff, problem.batch
    closed, shape = jax.make_jaxpr(step, return_shape=True)(diff, batch)
    outputs, producer = interpret.run(closed, jax.tree.leaves((diff, batch)))
    (_, loss), grads = jax.tree.unflatten(jax.tree.structure(shape), outputs)
    inverse = 1.0 / float(state.scale)
    bad = tuple(
        path
        for path, g in zip(problem.diff_paths, grads, strict=True)
        if interpret.nonfinite(jnp.asarray(g, jnp.float32) * inverse)
    )
    loss = float(loss)
    kind = "forward" if not np.isfinite(loss) else ("backward" if bad else None)
    return OverflowReport(
        kind=kind,
        leaves=bad,
        op=None if kind is None or producer is None else producer.op,
        source=None if kind is None or producer is None else producer.source,
        function=None if kind is None or producer is None else producer.function,
        backward_pass=bool(kind and producer and producer.backward),
        scale=float(state.scale),
        loss=loss,
    )


def _state(loss_scale: Any) -> Any:
    if checks.is_number(loss_scale):
        return kinds.StaticLossScale(loss_scale)
    return lookup.find(loss_scale, "loss_scale")
