"""`preflight_step`: a train step's result must not depend on the loss scale.

Loss scaling multiplies the loss by `s` and divides the gradients by `s` before
anything reads them. At two scales a power of two apart every scaled value is
the same up to that power of two (a multiplication by 2 is exact), so a correct
step applies the same update at both, bit for bit but for values at the bottom
of float16's range. A step that differentiates the unscaled loss and lets
`wrap` unscale it, or that clips before `wrap`, updates by `g / s`: half as
much at twice the scale under SGD, and under Adam unless the gradients are large
next to its `eps` times the scale (docs/guides/wrap.md).

And a step must return the loss-scale state its update returned. One that
returns the state it was given trains on silently: no skip is counted, the
scale never moves. At a scale of inf the step must skip (the gradients of a
scaled loss are not finite there) or, with an unscaled loss, apply: either way
the state it returns differs from the one it was given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale._src.api import lookup
from lossscale._src.diagnostics import holders
from lossscale._src.diagnostics import step_findings
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
    leaves whose updates differ. Once more at a scale of inf, where the step
    must skip: one that returns the loss-scale state it was given, not the one
    its update returned, gets `loss-scale-not-returned`. Run it once, on one
    batch, before training.

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
      >>> report = lossscale.diagnostics.preflight_step(step, state, jnp.ones(3))
      >>> print(sorted(report.codes), report.findings[0].where)
      ['scale-dependent-step'] [0]
    """
    if not callable(step):
        raise TypeError(f"`step` must be callable, got {type(step).__name__}.")
    current = holders.values(lookup.find(state, "state"))
    high = _settable(current)
    for _ in range(_TRIES):
        low = high / 2
        results = [_run(step, state, args, _at(current, s)) for s in (low, high)]
        if not any(skipped for _, skipped, _ in results):
            break
        high /= 2**4
    else:
        raise ValueError(
            f"The step skipped its update at every pair of scales tried, from"
            f" {power(float(current.scale))} down to {power(high * 2**4)}: its"
            " gradients are not finite at any of them. Run"
            " `lossscale.diagnostics.preflight` on its loss to see why."
        )
    before = _float_leaves(state)
    (a, _, _), (b, _, _) = results
    # At a scale of inf the gradients of a scaled loss are not finite: a step
    # that applies its update there differentiates the unscaled loss. With one
    # skip pending, an applied step resets `consecutive_skips` and a skip adds
    # one, whatever the kind: a step that returns this very state dropped the
    # state its update returned.
    infinite = _at(current, float("inf")).replace(consecutive_skips=1)
    _, skipped_at_inf, returned = _run(step, state, args, infinite)
    differ: step_findings.Differences = {}
    for path, old in before.items():
        change_a = np.asarray(a[path], np.float64) - np.asarray(old, np.float64)
        change_b = np.asarray(b[path], np.float64) - np.asarray(old, np.float64)
        size = max(np.linalg.norm(change_a), np.linalg.norm(change_b))
        gap = np.linalg.norm(change_a - change_b)
        if not np.isfinite(gap) or gap > TOLERANCE * size:
            differ[path] = (
                float(gap / size) if size else np.inf,
                _ratio(change_a, change_b),
            )
    notes = (
        f"Step run at scales {power(low)} and {power(high)}; {len(before)}"
        " floating-point leaves compared. Run at a scale of inf: it"
        + (" skipped." if skipped_at_inf else " applied its update."),
    )
    if returned == infinite:
        finding = step_findings.not_returned(state, differ)
        return PreflightReport((finding,), None, notes)
    if not differ:
        return PreflightReport((), None, notes)
    finding = step_findings.scale_dependent(
        state, differ, len(before), low, high, not skipped_at_inf
    )
    return PreflightReport((finding,), None, notes)


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
    """`state` at `scale` (a static scale is a setting: a new state; not inf)."""
    if isinstance(state, StaticLossScale):
        if not np.isfinite(scale):
            return kinds.DynamicLossScale().replace(scale=scale)
        return StaticLossScale(scale)
    return state.replace(scale=jnp.asarray(scale, jnp.float32))


def _run(step, state, args, loss_scale):
    """The step's new floating-point leaves with `loss_scale`; whether it skipped.

    And the loss-scale state the step returned.
    """
    given = holders.with_loss_scale(state, loss_scale)
    # Copies of every array: the step may donate its arguments, and these are
    # the caller's (the loss-scale state's counters too).
    given, copies = jax.tree.map(
        lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x,
        (given, args),
    )
    before = int(loss_scale.skipped_steps)
    out = step(given, *copies)
    # The caller's own objects, not the copies the step was given (and may donate).
    _refuse_donated({"state": state, "args": args, "loss_scale": loss_scale})
    paths = set(_float_leaves(state))
    if set(_float_leaves(out)) != paths and isinstance(out, tuple | list) and out:
        out = out[0]
    if set(_float_leaves(out)) != paths:
        raise TypeError(
            "`step` must return the new state (the tree it was given, with the"
            " loss-scale state updated), or a tuple whose first element is; it"
            f" returned a {type(out).__name__} with other floating-point leaves."
        )
    returned = holders.values(lookup.find(out, "step(state, ...)"))
    return _float_leaves(out), int(returned.skipped_steps) > before, returned


def _refuse_donated(caller: Any) -> None:
    """Raises if the step deleted (donated) arrays of the caller's objects.

    It was given copies: a step that donates the caller's own arrays runs on
    objects bound to it (`nnx.cached_partial`, a trainer's jitted step), not on
    the state it is given, so neither the scales tried reach it nor can the
    caller's objects be read after it.
    """
    variable = holders.variable_type()
    leaves, _ = jax.tree_util.tree_flatten_with_path(
        caller, is_leaf=lambda x: variable is not None and isinstance(x, variable)
    )
    for path, leaf in leaves:
        if variable is not None and isinstance(leaf, variable):
            leaf = lookup.variable_value(leaf)
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            raise ValueError(
                "`step` donated (deleted) an array of the caller's objects, at"
                f" {jax.tree_util.keystr(path)}, while `preflight_step` ran it on"
                " copies: the step runs on objects bound to it (as"
                " `nnx.cached_partial` or a framework's jitted step binds the model"
                " and the optimizer), not on the `state` it is given, so the scales"
                " the check sets never reach it. Pass a step that takes the state as"
                " its first argument: the train step itself, jitted or not, e.g."
                " `lambda state, batch: (train_step(*state, batch), state)[1]` over"
                " `state = (model, optimizer)`. Donating its arguments is fine."
            )


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
