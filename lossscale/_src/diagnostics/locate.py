"""Saying where an overflow happened: the gradient leaf, the op and its line."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale._src import validation
from lossscale._src.api import functional
from lossscale._src.api import lookup
from lossscale._src.diagnostics.engine import interpret
from lossscale._src.diagnostics.engine import program
from lossscale._src.diagnostics.findings import listed
from lossscale._src.state import kinds

# No op made the first inf or NaN: it was in the input, or there is none.
_NO_PRODUCER = interpret.Producer(op=None, backward=False, source=None, function=None)


@dataclasses.dataclass(frozen=True)
class OverflowReport:
    """Where a step overflowed, from `lossscale.diagnostics.locate_overflow`.

    Attributes:
      kind: "forward" (the loss is not finite: no scale fixes it), "backward"
        (the loss is finite, some gradients are not) or None (all finite).
      leaves: the paths (`jax.tree_util.keystr`) of the parameters whose
        unscaled gradients are not finite, in `jax.tree.leaves` order.
      op: the primitive that made the first inf or NaN reaching the loss (a
        forward overflow) or those gradients (a backward one), from inputs
        without any; None if none did (see `nonfinite_input`).
      source: `"file:line"` of the user's code that called that op.
      function: the function that line is in.
      backward_pass: whether that op is in the backward pass.
      scale: the loss scale the step was evaluated at.
      loss: the unscaled loss, as a Python float.
      nonfinite_input: when the inf or NaN was in the input itself, before any
        op, which input: `loss_fn`'s argument name and path (e.g.
        `"x"`, `"batch['image']"`, `"params['w']"`); else None.
      state_scale: when `loss_scale` was a state whose latest step was skipped
        and whose scale has moved since (a dynamic scale backs off), the scale
        it holds now; `scale` is then the one the skipped step ran at. Else None.

    Examples:
      >>> import jax.numpy as jnp, lossscale
      >>> report = lossscale.diagnostics.locate_overflow(
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
    nonfinite_input: str | None = None
    state_scale: float | None = None

    def __str__(self) -> str:
        at = self._at()
        if self.kind is None:
            finite = f"No overflow at {at}: the loss ({self.loss:g}) and every gradient"
            if self.state_scale is None:
                return f"{finite} are finite."
            return (
                f"{finite} are finite. That step overflowed on another batch, or"
                " (under `axis_name`) in another device's part of it: rerun the"
                " batch it was given."
            )
        if self.nonfinite_input is not None:
            return (
                f"The input is not finite: `{self.nonfinite_input}` holds an inf or a"
                f" NaN before any op runs ({at}, loss"
                f" {self.loss:g}).{self._grads()} No loss scale or float32 cast"
                " fixes that: clean the data (or the parameters) it comes from, or"
                " skip such batches; with `value=loss` the step skips them without"
                " backing off the scale."
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
        grads = self._grads()
        if self.kind == "forward":
            return (
                f"Forward overflow at {at}: the loss is"
                f" {self.loss:g}.{where}{grads} No loss scale fixes a forward"
                " overflow: compute that op in float32 (cast its input with"
                " `.astype(jnp.float32)`), or keep its input within float16's range"
                " (e.g. subtract the max before `exp`, as `jax.nn.softmax` does)."
            )
        if self.op is not None and not self.backward_pass:
            # Made before the loss is scaled: the same at every scale.
            return (
                f"Backward overflow at {at}: the loss"
                f" ({self.loss:g}) is finite.{grads}{where} No loss scale avoids it:"
                " that value does not depend on the scale, and the loss drops it but"
                " its gradient does not (0 * inf is NaN). Keep it within float16's"
                " range (a mask constant of `jnp.finfo(jnp.float16).min`, not -inf"
                " or -1e30, which float16 rounds to -inf), or compute that op in"
                " float32."
            )
        return (
            f"Backward overflow at {at}: the loss"
            f" ({self.loss:g}) is finite.{grads}{where} A lower scale avoids it"
            " (a dynamic scale backs off by itself); if it overflows at low scales"
            " too, compute that op in float32."
        )

    def _at(self) -> str:
        """The scale checked, and after a skip where the state has moved since."""
        if self.state_scale is None:
            return f"loss scale {self.scale:g}"
        moved = "backed off" if self.state_scale < self.scale else "moved"
        return (
            f"loss scale {self.scale:g}, the scale the state's latest step ran at (it"
            f" was skipped, and the state has {moved} to {self.state_scale:g} since)"
        )

    def _grads(self) -> str:
        if self.leaves == ("",):  # the parameters are one array: its path is ""
            return " The gradient is not finite."
        return f" Non-finite gradients: {listed(self.leaves)}." if self.leaves else ""


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
    loss_scale)` one primitive at a time, on the host, differentiating the
    floating-point array leaves of `params`. Call it on the failing batch, outside
    the train step: it syncs after every op. An inf or NaN already in the input is
    named as such (`nonfinite_input`), not blamed on an op.

    Args:
      loss_fn: the loss function, as the step calls it: it returns a
        floating-point scalar, or `(loss, aux)` with `has_aux`.
      params: what the step differentiates: parameters, an NNX or Equinox model.
      *args: `loss_fn`'s further arguments (the batch).
      loss_scale: the scale to evaluate at: a loss-scale state, a tree holding
        one (the optimizer state), or a positive number. A state whose latest
        step was skipped is evaluated at the scale that step ran at (its
        `overflow_scale`), not at the one it has backed off to since.
      has_aux: whether `loss_fn` returns `(loss, aux)`.
      **kwargs: `loss_fn`'s keyword arguments.

    Returns:
      An `OverflowReport`; `str(report)` says what to do.

    Raises:
      TypeError: if `loss_fn` is not callable or cannot take the arguments,
        `has_aux` does not match it, `loss_scale` is none of the above, the
        loss is not a float scalar, or it is called under `jax.jit`.
      ValueError: if `loss_scale` is a number that is not positive and finite,
        or `params` has no floating-point array to differentiate.

    Examples:
      >>> import jax.numpy as jnp, lossscale
      >>> def loss_fn(params, x):
      ...     h = jnp.exp(x.astype(jnp.float16) * params["w"].astype(jnp.float16))
      ...     return jnp.sum(h.astype(jnp.float32))
      >>> report = lossscale.diagnostics.locate_overflow(
      ...     loss_fn, {"w": jnp.ones(2)}, jnp.array([1.0, 20.0]), loss_scale=1024.0)
      >>> print(report.kind, report.op, report.leaves)
      forward exp ("['w']",)
    """
    if program.tracer(params, args, kwargs, loss_scale) is not None:
        raise TypeError(
            "`locate_overflow` runs on the host, outside the train step, and got"
            " traced values (it was called inside `jax.jit`, `grad` or `vmap`)."
            " Call it after the step, on the failing batch and the optimizer"
            ' state, e.g. when `metrics(opt_state)["skipped_steps"]` grows.'
        )
    problem = program.Program.build(
        loss_fn, params, args, kwargs, has_aux,
        "locate_overflow(loss_fn, params, x, y, loss_scale=...)",
    )  # fmt: skip
    state, state_scale = _state(loss_scale)

    def scaled(diff, batch):
        loss, _ = problem.loss(diff, batch)
        return functional.scaled(loss, state), loss

    step = jax.value_and_grad(scaled, has_aux=True)
    diff, batch = problem.diff, problem.batch
    closed, shape = jax.make_jaxpr(step, return_shape=True)(diff, batch)
    found = interpret.run(closed, [*diff, *batch])
    treedef = jax.tree.structure(shape)
    (_, loss), grads = jax.tree.unflatten(treedef, found.outputs)
    (_, loss_origin), grad_origins = jax.tree.unflatten(treedef, found.origins)
    inverse = 1.0 / float(state.scale)
    bad = [
        position
        for position, g in enumerate(grads)
        if interpret.nonfinite(jnp.asarray(g, jnp.float32) * inverse)
    ]
    loss = float(loss)
    kind = "forward" if not np.isfinite(loss) else ("backward" if bad else None)
    # A forward overflow is the loss's; a backward one the gradients' earliest.
    blamed = [loss_origin] if kind == "forward" else [grad_origins[i] for i in bad]
    origins = [origin for origin in blamed if origin is not None]
    source = found.sources[min(origins)] if origins else None
    producer = source if isinstance(source, interpret.Producer) else _NO_PRODUCER
    return OverflowReport(
        kind=kind,
        leaves=tuple(problem.diff_paths[i] for i in bad),
        op=producer.op,
        source=producer.source,
        function=producer.function,
        backward_pass=producer.backward,
        scale=float(state.scale),
        loss=loss,
        nonfinite_input=(
            problem.input_names()[source] if isinstance(source, int) else None
        ),
        state_scale=state_scale,
    )


def _state(loss_scale: Any) -> tuple[Any, float | None]:
    """The state to evaluate at; and, after a skip, the scale the given one has now.

    The batch a skipped step was given overflowed at the scale that step ran at.
    The state it returned may have backed off since (a dynamic scale does), and
    at that lower scale the batch can be finite: so a state whose latest step
    was skipped is evaluated at the scale it records for that step.
    """
    found = lookup.scale_to_evaluate_at(loss_scale, "loss_scale", "locate_overflow")
    if validation.is_number(found):
        return kinds.StaticLossScale(found), None
    skips, ran_at, now = (
        np.asarray(x)
        for x in (found.consecutive_skips, found.overflow_scale, found.scale)
    )
    # 0: a state restored from a 0.3.0 checkpoint, which did not record it.
    if skips.ndim or not (skips > 0 and np.isfinite(ran_at) and ran_at > 0):
        return found, None
    if ran_at == now:
        return found, None
    return kinds.StaticLossScale(float(ran_at)), float(now)
