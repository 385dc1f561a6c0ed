"""`preflight_step`: a train step's result must not depend on the loss scale.

Loss scaling multiplies the loss by `s` and divides the gradients by `s` before
anything reads them. At two scales a power of two apart every scaled value is
the same up to that power of two (a multiplication by 2 is exact), so a correct
step applies the same update at both, bit for bit but for values at the bottom
of float16's range. A step that differentiates the unscaled loss and lets
`wrap` unscale it, or that clips before `wrap`, updates by `g / s`: half as
much at twice the scale, which Adam's normalisation hides and SGD does not.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale._src.api import lookup
from lossscale._src.api.wrapper import WrapState
from lossscale._src.diagnostics.findings import Finding
from lossscale._src.diagnostics.findings import PreflightReport
from lossscale._src.diagnostics.findings import power
from lossscale._src.state import kind_fields
from lossscale._src.state import kinds
from lossscale._src.state.kind import LossScale
from lossscale._src.state.kinds import StaticLossScale

# An update that differs by more than 2**-8 of its norm between the two scales
# differs by more than rounding: scaling by a power of two is exact, and the
# values rounded differently (float16 subnormals at the lower scale) are below
# 2**-14 of the largest, far less than 2**-8 of the norm.
TOLERANCE = 2.0**-8
# Scales tried, halving from the state's, when a step skips at one of them.
_TRIES = 24


def preflight_step(step: Callable[..., Any], state: Any, *args: Any) -> PreflightReport:
    """Checks that a train step's result does not depend on the loss scale.

    Runs `step(state, *args)` on the host at two loss scales a power of two
    apart (the state's scale and half of it, lower if the step skips there),
    copying `state` first for each. A correctly scaled step applies the same
    update at both; one that is not gets `scale-dependent-step`, naming the
    leaves whose updates differ. Run it once, on one batch, before training.

    Args:
      step: the train step, jitted or not: takes `state` (a tree holding one
        loss-scale state, as `get_loss_scale` finds it) and `*args`; returns
        the new state, or a tuple whose first element is the new state.
      state: the train state (e.g. `(params, opt_state)`, a `TrainState`).
      *args: the rest of `step`'s arguments: one batch.

    Returns:
      A `PreflightReport` (its `scale` is None: no scale is probed).

    Raises:
      TypeError: if `step` is not callable or returns another tree.
      ValueError: if `state` holds no (or several) loss-scale states, one
        whose scale cannot be set, or the step skips at every scale tried.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, lossscale
      >>> tx = lossscale.wrap(optax.sgd(0.1))
      >>> def step(state, x):
      ...     params, opt_state = state
      ...     grads = jax.grad(lambda p: jnp.sum(p * x))(params)  # not scaled!
      ...     updates, opt_state = tx.update(grads, opt_state, params)
      ...     return optax.apply_updates(params, updates), opt_state
      >>> params = jnp.zeros(3)
      >>> state = (params, tx.init(params))
      >>> report = lossscale.preflight_step(step, state, jnp.ones(3))
      >>> print(sorted(report.codes), report.findings[0].where)
      ['scale-dependent-step'] [0]
    """
    if not callable(step):
        raise TypeError(f"`step` must be callable, got {type(step).__name__}.")
    current = lookup.find(state, "state")
    high = _settable(current)
    for _ in range(_TRIES):
        low = high / 2
        results = [_run(step, state, args, _at(current, s)) for s in (low, high)]
        if not any(skipped for _, skipped in results):
            break
        high /= 2**4
    else:
        raise ValueError(
            f"The step skipped its update at every pair of scales tried, from"
            f" {power(float(current.scale))} down to {power(high * 2**4)}: its"
            " gradients are not finite at any of them. Run `lossscale.preflight` on"
            " its loss to see why."
        )
    before = _float_leaves(state)
    (a, _), (b, _) = results
    differ = {}
    for path, old in before.items():
        change_a = np.asarray(a[path], np.float64) - np.asarray(old, np.float64)
        change_b = np.asarray(b[path], np.float64) - np.asarray(old, np.float64)
        size = max(np.linalg.norm(change_a), np.linalg.norm(change_b))
        gap = np.linalg.norm(change_a - change_b)
        if not np.isfinite(gap) or gap > TOLERANCE * size:
            differ[path] = (gap / size if size else np.inf, _ratio(change_a, change_b))
    notes = (
        f"Step run at scales {power(low)} and {power(high)}; {len(before)}"
        " floating-point leaves compared.",
    )
    if not differ:
        return PreflightReport((), None, notes)
    listed = "; ".join(
        f"{path} (differs by {gap:.0%}"
        + (f", {ratio:.3g}x at the lower scale)" if ratio else ")")
        for path, (gap, ratio) in list(differ.items())[:3]
    )
    more = f"; and {len(differ) - 3} more leaves" if len(differ) > 3 else ""
    # At a scale of inf the gradients of a scaled loss are not finite: a step
    # that applies its update there differentiates the unscaled loss.
    infinite = kinds.DynamicLossScale().replace(scale=float("inf"))
    unscaled = not _run(step, state, args, infinite)[1]
    finding = Finding(
        code="scale-dependent-step",
        severity="error",
        message=(
            f"The step's update changes with the loss scale: at {power(low)} and"
            f" {power(high)} it differs in {len(differ)} of {len(before)} leaves:"
            f" {listed}{more}. "
            + (
                "Its gradients are not those of the scaled loss (they stay finite"
                " at a scale of inf), and the unscaling divides them by the scale."
                if unscaled
                else "Its gradients are those of the scaled loss (not finite at a"
                " scale of inf), but a transformation reads them before they are"
                " unscaled (e.g. a clip)."
            )
            + " With Adam the step may still train (its normalisation hides a"
            " factor); with SGD it stalls, and `metrics` look healthy."
        ),
        where=next(iter(differ)),
        fix=_fix(state, unscaled),
    )
    return PreflightReport((finding,), None, notes)


def _fix(state: Any, unscaled: bool) -> str:
    """The fix of either mistake, for the API that holds the loss-scale state."""
    # A `lossscale.flax.TrainState` exists only once its module is imported.
    module = sys.modules.get("lossscale._src.api.flax_training")
    train_state = getattr(module, "TrainState", WrapState)
    nodes = jax.tree.leaves(
        state, is_leaf=lambda x: isinstance(x, WrapState | train_state)
    )
    chain = "`optax.chain(optax.clip_by_global_norm(1.0), inner)`"
    untouched = f"or a `tx` that clips ({chain}); pass it the gradients untransformed"
    if any(isinstance(x, WrapState) for x in nodes):
        scale_from = "opt_state, params"
        clip = (
            f"`lossscale.wrap({chain[1:-1]})` or `lossscale.wrap(inner,"
            " clip_norm=1.0)`, not `optax.chain(clip, lossscale.wrap(inner))`"
        )
    elif any(isinstance(x, train_state) for x in nodes):
        scale_from = "state, state.params"
        clip = f"`TrainState.create(..., clip_norm=1.0)`, {untouched}"
    else:
        scale_from = "loss_scale, params"
        clip = f"`lossscale.apply_gradients(..., clip_norm=1.0)`, {untouched}"
    if unscaled:
        return (
            "Differentiate the scaled loss: `loss, grads ="
            f" lossscale.value_and_grad(loss_fn)({scale_from}, ...)`."
        )
    return f"Transform the gradients after the unscaling: {clip}."


def _settable(state: LossScale) -> float:
    """The state's scale; raises unless a state of its kind can take another."""
    if isinstance(state, StaticLossScale) or "scale" in kind_fields.leaf_names(
        type(state)
    ):
        return float(state.scale)
    raise ValueError(
        f"`state` holds a `{type(state).__name__}`, whose scale cannot be set: the"
        " check runs the step at two scales. Pass the state with a"
        " `DynamicLossScale` or a `StaticLossScale` (e.g. build the optimizer with"
        " `lossscale.wrap(inner, 'dynamic')` for this check)."
    )


def _at(state: LossScale, scale: float) -> LossScale:
    """`state` at `scale` (a static scale is a setting: a new state)."""
    if isinstance(state, StaticLossScale):
        return StaticLossScale(scale)
    return state.replace(scale=jnp.asarray(scale, jnp.float32))


def _run(step, state, args, loss_scale) -> tuple[dict[str, Any], bool]:
    """The step's new floating-point leaves with `loss_scale`; whether it skipped."""
    given = with_loss_scale(state, loss_scale)
    # Copies of every array: the step may donate its arguments, and these are
    # the caller's (the loss-scale state's counters too).
    given, args = jax.tree.map(
        lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x,
        (given, args),
    )
    before = int(loss_scale.skipped_steps)
    out = step(given, *args)
    paths = set(_float_leaves(state))
    if set(_float_leaves(out)) != paths and isinstance(out, tuple | list) and out:
        out = out[0]
    if set(_float_leaves(out)) != paths:
        raise TypeError(
            "`step` must return the new state (the tree it was given, with the"
            " loss-scale state updated), or a tuple whose first element is; it"
            f" returned a {type(out).__name__} with other floating-point leaves."
        )
    after = int(lookup.find(out, "step(state, ...)").skipped_steps)
    return _float_leaves(out), after > before


def _float_leaves(tree: Any) -> dict[str, Any]:
    """The floating-point array leaves of `tree` by path, loss-scale states left out."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, LossScale)
    )
    return {
        jax.tree_util.keystr(path): leaf
        for path, leaf in leaves
        if not isinstance(leaf, LossScale)
        and jnp.issubdtype(getattr(leaf, "dtype", np.int32), jnp.floating)
    }


def _ratio(a: np.ndarray, b: np.ndarray) -> float | None:
    """`|a| / |b|` if `a` is a multiple of `b` (a factor from the scale)."""
    norm_b = np.linalg.norm(b)
    if not norm_b or not np.isfinite(norm_b):
        return None
    ratio = np.linalg.norm(a) / norm_b
    if np.linalg.norm(a - ratio * b) > TOLERANCE * np.linalg.norm(a):
        return None
    return float(ratio)


def with_loss_scale(tree: Any, loss_scale: LossScale) -> Any:
    """`tree` with `loss_scale` in place of each loss-scale state it holds."""
    return jax.tree.map(
        lambda x: loss_scale if isinstance(x, LossScale) else x,
        tree,
        is_leaf=lambda x: isinstance(x, LossScale),
    )
