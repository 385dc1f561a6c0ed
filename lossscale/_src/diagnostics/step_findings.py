"""What `preflight_step` says: its two findings, each with the fix for the API used."""

from __future__ import annotations

import sys
from typing import Any

import jax

from lossscale._src.api import lookup
from lossscale._src.api.wrapper import WrapState
from lossscale._src.diagnostics.findings import Finding
from lossscale._src.diagnostics.findings import power

# Leaf path -> (the gap between the two updates over their size, the factor
# between them, or None when they are not multiples of each other).
Differences = dict[str, tuple[float, float | None]]


def scale_dependent(
    state: Any, differ: Differences, compared: int, low: float, high: float,
    unscaled: bool,
) -> Finding:  # fmt: skip
    """`scale-dependent-step`: the update at `low` and at `high` differ."""
    return Finding(
        code="scale-dependent-step",
        severity="error",
        message=(
            f"The step's update changes with the loss scale: at {power(low)} and"
            f" {power(high)} it differs in {len(differ)} of {compared} leaves:"
            f" {listed(differ)}. "
            + (
                "Its gradients are not those of the scaled loss (they stay finite"
                " at a scale of inf), and the unscaling divides them by the scale."
                if unscaled
                else "Its gradients are those of the scaled loss (not finite at a"
                " scale of inf), but a transformation reads them before they are"
                " unscaled (e.g. a clip)."
            )
            + " With SGD it stalls; with Adam it trains only where the gradients"
            " are large next to Adam's `eps` times the scale (a loss averaged over"
            " many tokens has smaller ones); and `metrics` look healthy."
        ),
        where=next(iter(differ)),
        fix=_scale_fix(_api(state), unscaled),
    )


def not_returned(state: Any, differ: Differences) -> Finding:
    """`loss-scale-not-returned`: the step returns the loss-scale state it was given."""
    path = jax.tree_util.keystr(lookup.find_all(state)[0][0])
    also = (
        f" Its update also changes with the loss scale ({listed(differ)}): fix"
        " this first, then run `preflight_step` again."
        if differ
        else ""
    )
    fix = {
        "wrap": "Keep the optimizer state that `tx.update` returns (`updates,"
        " opt_state = tx.update(grads, opt_state, params)`) and return it from"
        " the step.",
        "TrainState": "Return the state that `state.apply_gradients(grads=grads)`"
        " returns, its `loss_scale` included, from the step.",
        "apply_gradients": "Keep all three results (`params, opt_state,"
        " loss_scale = lossscale.apply_gradients(...)`) and return the new"
        " `loss_scale` from the step.",
        "Optimizer": "Call `optimizer.update(model, grads, value=loss)` in the"
        " step, and return the model and the optimizer it updated.",
    }[_api(state)]
    return Finding(
        code="loss-scale-not-returned",
        severity="error",
        message=(
            "The step returns the loss-scale state it was given, not the one its"
            " update returned: run with gradients that are not finite (a scale of"
            " inf), where it must skip and count the skip, the state it returned"
            " is the state it was given. Such a step trains on, but its skips are"
            " never counted and its scale never backs off or grows, and `metrics`"
            f" look healthy.{also}"
        ),
        where=path or None,
        fix=fix,
    )


def listed(differ: Differences) -> str:
    """The first leaves whose updates differ, by how much."""
    text = "; ".join(
        f"{path} (differs by {gap:.0%}"
        + (f", {ratio:.3g}x at the lower scale)" if ratio else ")")
        for path, (gap, ratio) in list(differ.items())[:3]
    )
    more = f"; and {len(differ) - 3} more leaves" if len(differ) > 3 else ""
    return text + more


def _api(state: Any) -> str:
    """Which API holds the loss-scale state (Flax NNX's is "Optimizer")."""
    # Flax's classes exist only once `lossscale.flax` is imported.
    module = sys.modules.get("lossscale._src.api.flax_training")
    kinds = {
        "Optimizer": getattr(module, "Optimizer", None),  # holds a `WrapState`
        "wrap": WrapState,
        "TrainState": getattr(module, "TrainState", None),
    }
    known = tuple(kind for kind in kinds.values() if kind is not None)
    nodes = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, known))
    for name, kind in kinds.items():
        if kind is not None and any(isinstance(x, kind) for x in nodes):
            return name
    return "apply_gradients"


def _scale_fix(api: str, unscaled: bool) -> str:
    """The fix of either mistake of `scale-dependent-step`, for `api`."""
    chain = "`optax.chain(optax.clip_by_global_norm(1.0), inner)`"
    untouched = f"or a `tx` that clips ({chain}); pass it the gradients untransformed"
    scale_from, clip = {
        "wrap": (
            "opt_state, params",
            f"`lossscale.wrap({chain[1:-1]})` or `lossscale.wrap(inner,"
            " clip_norm=1.0)`, not `optax.chain(clip, lossscale.wrap(inner))`",
        ),
        "TrainState": (
            "state, state.params",
            f"`TrainState.create(..., clip_norm=1.0)`, {untouched}",
        ),
        "Optimizer": (
            None,
            "`lossscale.flax.Optimizer(model, tx, wrt=nnx.Param, clip_norm=1.0)`,"
            f" {untouched}",
        ),
        "apply_gradients": (
            "loss_scale, params",
            f"`lossscale.apply_gradients(..., clip_norm=1.0)`, {untouched}",
        ),
    }[api]
    if unscaled and scale_from is None:
        return (
            "Differentiate the scaled loss: in the function given to"
            " `nnx.value_and_grad`, `return lossscale.scale_loss(loss, optimizer),"
            " loss` (with `has_aux=True`)."
        )
    if unscaled:
        return (
            "Differentiate the scaled loss: `loss, grads ="
            f" lossscale.value_and_grad(loss_fn)({scale_from}, ...)`."
        )
    return f"Transform the gradients after the unscaling: {clip}."
