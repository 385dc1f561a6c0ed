"""Saying where an overflow happened: the gradient leaf, the op and its line."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale._src import checks
from lossscale._src import functional
from lossscale._src import grad
from lossscale._src import interpret
from lossscale._src import kinds
from lossscale._src import lookup


@dataclasses.dataclass(frozen=True)
class OverflowReport:
    """Where a step overflowed, from `lossscale.locate_overflow`.

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
    nonfinite_input: str | None = None

    def __str__(self) -> str:
        if self.kind is None:
            return (
                f"No overflow at loss scale {self.scale:g}: the loss ({self.loss:g})"
                " and every gradient are finite."
            )
        if self.nonfinite_input is not None:
            return (
                f"The input is not finite: `{self.nonfinite_input}` holds an inf or a"
                f" NaN before any op runs (loss scale {self.scale:g}, loss"
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

    def _grads(self) -> str:
        named = ", ".join(self.leaves[:3]) + (
            f" and {len(self.leaves) - 3} more" if len(self.leaves) > 3 else ""
        )
        return f" Non-finite gradients: {named}." if self.leaves else ""


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
    floating-point array leaves of `params` (an Equinox model's functions are
    held fixed). Call it on the failing batch, outside the train step: it syncs
    after every op (seconds for a small model, minutes for a large one). The
    walk goes into `jax.jit`, `jax.checkpoint` and custom derivative rules. An
    inf or NaN already in the input (the batch, or `params`) is named as such,
    in `nonfinite_input`, not blamed on an op.

    Args:
      loss_fn: the loss function, as the step calls it: it returns a
        floating-point scalar, or `(loss, aux)` with `has_aux`.
      params: what the step differentiates: parameters, an NNX or Equinox model.
      *args: `loss_fn`'s further arguments (the batch).
      loss_scale: the scale to evaluate at: a loss-scale state, a tree holding
        one (the optimizer state), or a positive number.
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
      >>> report = lossscale.locate_overflow(
      ...     loss_fn, {"w": jnp.ones(2)}, jnp.array([1.0, 20.0]), loss_scale=1024.0)
      >>> print(report.kind, report.op, report.leaves)
      forward exp ("['w']",)
    """
    if not callable(loss_fn):
        raise TypeError(f"`loss_fn` must be callable, got {type(loss_fn).__name__}.")
    if not isinstance(has_aux, bool):
        raise TypeError(f"`has_aux` must be a bool, got {has_aux!r}.")
    if any(
        isinstance(leaf, jax.core.Tracer)
        for leaf in jax.tree.leaves((params, args, kwargs, loss_scale))
    ):
        raise TypeError(
            "`locate_overflow` runs on the host, outside the train step, and got"
            " traced values (it was called inside `jax.jit`, `grad` or `vmap`)."
            " Call it after the step, on the failing batch and the optimizer"
            ' state, e.g. when `metrics(opt_state)["skipped_steps"]` grows.'
        )
    _check_call(loss_fn, params, args, kwargs)
    state = _state(loss_scale)
    paths, leaves, treedef = _flatten_with_paths(params)
    differentiated = [i for i, leaf in enumerate(leaves) if _inexact_array(leaf)]
    if not differentiated:
        raise ValueError(
            "`params` has no floating-point array to differentiate; pass what the"
            " train step differentiates (the parameters, or the model)."
        )
    # The batch's arrays are traced too (keyword arguments included), so that an
    # inf or NaN in the data is named as such, not blamed on the first op.
    batch_with_paths, batch_tree = jax.tree_util.tree_flatten_with_path((args, kwargs))
    batch_leaves = [leaf for _, leaf in batch_with_paths]
    arrays = [i for i, leaf in enumerate(batch_leaves) if _array(leaf)]

    def rebuild(values, positions, template, tree):
        out = list(template)
        for i, value in zip(positions, values, strict=True):
            out[i] = value
        return jax.tree.unflatten(tree, out)

    def scaled(diff, batch):
        call_args, call_kwargs = rebuild(batch, arrays, batch_leaves, batch_tree)
        out = loss_fn(
            rebuild(diff, differentiated, leaves, treedef), *call_args, **call_kwargs
        )
        loss, _ = grad.split_loss(out, has_aux, "loss_fn", "loss_fn(params, ...)")
        return functional.scale_loss(loss, state), loss

    def step(diff, batch):
        return jax.value_and_grad(scaled, has_aux=True)(diff, batch)

    diff = [leaves[i] for i in differentiated]
    batch = [batch_leaves[i] for i in arrays]
    closed, shape = jax.make_jaxpr(step, return_shape=True)(diff, batch)
    found = interpret.run(closed, [*diff, *batch])
    (_, loss), grads = jax.tree.unflatten(jax.tree.structure(shape), found.outputs)
    (_, loss_origin), grad_origins = jax.tree.unflatten(
        jax.tree.structure(shape), found.origins
    )
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
    names = _input_names(loss_fn, len(args))
    inputs = [f"{names[0]}{paths[i]}" for i in differentiated] + [
        _argument_name(batch_with_paths[i][0], names) for i in arrays
    ]
    producer = source if isinstance(source, interpret.Producer) else None
    return OverflowReport(
        kind=kind,
        leaves=tuple(paths[differentiated[i]] for i in bad),
        op=None if producer is None else producer.op,
        source=None if producer is None else producer.source,
        function=None if producer is None else producer.function,
        backward_pass=producer is not None and producer.backward,
        scale=float(state.scale),
        loss=loss,
        nonfinite_input=inputs[source] if isinstance(source, int) else None,
    )


def _flatten_with_paths(tree: Any) -> tuple[list[str], list[Any], Any]:
    """`(keystr paths, leaves, treedef)` of `tree`."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [jax.tree_util.keystr(path) for path, _ in with_paths]
    return paths, [leaf for _, leaf in with_paths], treedef


def _check_call(loss_fn: Any, params: Any, args: tuple, kwargs: dict) -> None:
    """Raises `TypeError` if `loss_fn(params, *args, **kwargs)` cannot bind."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # no signature to read: the call decides
        return
    try:
        signature.bind(params, *args, **kwargs)
    except TypeError as error:
        raise TypeError(
            f"`loss_fn{signature}` cannot take `(params, *args, **kwargs)` as"
            f" given ({len(args)} positional argument(s) after `params`, keywords"
            f" {sorted(kwargs)}): {error}. Pass its arguments as the train step"
            " does: `locate_overflow(loss_fn, params, x, y, loss_scale=...)` for"
            " `loss_fn(params, x, y)`."
        ) from None


def _input_names(loss_fn: Callable[..., Any], count: int) -> list[str]:
    """The names `loss_fn` gives `params` and its `count` further arguments."""
    try:
        parameters = inspect.signature(loss_fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin)
        parameters = []
    positional = [
        p.name
        for p in parameters
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    defaults = ["params"] + [f"args[{i}]" for i in range(count)]
    return positional[: count + 1] + defaults[len(positional) :]


def _argument_name(path: tuple[Any, ...], names: list[str]) -> str:
    """A leaf of `(args, kwargs)` by its argument's name and its path inside it."""
    which, key, inside = path[0].idx, path[1], jax.tree_util.keystr(path[2:])
    return f"{names[key.idx + 1] if which == 0 else key.key}{inside}"


def _state(loss_scale: Any) -> Any:
    found = lookup.scale_to_evaluate_at(loss_scale, "loss_scale", "locate_overflow")
    return kinds.StaticLossScale(found) if checks.is_number(found) else found


def _array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray | np.generic)


def _inexact_array(leaf: Any) -> bool:
    return _array(leaf) and jnp.issubdtype(leaf.dtype, jnp.inexact)
