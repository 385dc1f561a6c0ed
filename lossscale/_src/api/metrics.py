"""Diagnostics: scalars for logging, and how close gradients sit to float16's limits."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale._src import validation
from lossscale._src.api import lookup
from lossscale._src.state.update import was_applied
from lossscale._src.step import unscaling

_FLOAT16 = np.finfo(np.float16)
# Nonzero magnitudes below the smallest subnormal (2**-24) are lost in float16.
_SMALLEST_SUBNORMAL = float(_FLOAT16.smallest_subnormal)
# Magnitudes at or above max + ulp/2 (65520) round to inf in float16.
_OVERFLOW_THRESHOLD = unscaling.overflow_threshold(np.float16)


def grad_stats(grads: Any, loss_scale: Any = None) -> dict[str, Any]:
    """Returns where the gradients sit in float16's range, at a loss scale.

    Pass the true (unscaled) gradients, e.g. `lossscale.unscale_grads` of a
    float16 step; each value `g` is looked at as `|g| * scale` would be in
    float16. Usable under `jax.jit`: nothing is copied to the host.

    Args:
      grads: a pytree of floating-point gradients.
      loss_scale: the scale to evaluate at: a positive number (a scale to try),
        `None` (1), or a loss-scale state or a tree holding one (its scale).

    Returns:
      A dict with the overall figures and, under `"leaves"`, the same figures per
      leaf, keyed by the leaf's path (`jax.tree_util.keystr`):

      * `max_abs`: float32, the largest `|g|` (unscaled; inf or NaN if any is);
      * `zero_fraction`: float32, share of elements exactly zero;
      * `underflow_fraction`: share of non-zero elements with `|g| * scale`
        below float16's smallest subnormal, 2**-24 (lost to zero);
      * `overflow_fraction`: share of elements with `|g| * scale` at or above
        65520 (rounds to inf in float16), non-finite elements included;
      * `headroom_bits`: `log2(65504 / (max_abs * scale))`, the doublings of the
        scale left before the largest gradient overflows float16 (negative when
        it already does; inf for an all-zero tree).

    Raises:
      TypeError: if a leaf is not floating point or is a
        `jax.experimental.sparse` array, or `loss_scale` is none of the above.
      ValueError: if `loss_scale` is a number that is not positive and finite.

    Examples:
      >>> import jax.numpy as jnp, lossscale
      >>> grads = {"w": jnp.array([1e-9, 0.0, 2.0, 3e-6])}
      >>> stats = lossscale.diagnostics.grad_stats(grads)
      >>> print(stats["zero_fraction"], stats["underflow_fraction"])
      0.25 0.25
      >>> print(lossscale.diagnostics.grad_stats(grads, 1024)["underflow_fraction"])
      0.0
    """
    validation.refuse_sparse(grads, "grads")
    scale = _scale_to_evaluate_at(loss_scale)
    per_leaf = {}
    # An empty leaf's counts change no total: the figures of a tree with no leaves.
    totals = [_leaf_counts(jnp.zeros([0], jnp.float32), scale)]
    for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
        leaf = jnp.asarray(leaf)
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise TypeError(
                "`grad_stats` takes floating-point gradients; the leaf at"
                f" {jax.tree_util.keystr(path) or '<root>'} has dtype {leaf.dtype}."
            )
        counts = _leaf_counts(leaf, scale)
        totals.append(counts)
        per_leaf[jax.tree_util.keystr(path) or "<root>"] = _figures(counts, scale)
    overall = {
        key: (
            _max_keeping_nan(jnp.stack([c[key] for c in totals]))
            if key == "max_abs"
            else sum(c[key] for c in totals)
        )
        for key in totals[0]
    }
    return {**_figures(overall, scale), "leaves": per_leaf}


def _leaf_counts(leaf: jax.Array, scale: jax.Array) -> dict[str, jax.Array]:
    magnitude = jnp.abs(leaf.astype(jnp.float32))
    scaled = magnitude * scale
    zero = magnitude == 0
    return {
        "size": jnp.asarray(leaf.size, jnp.float32),
        "max_abs": _max_keeping_nan(magnitude),
        "zeros": jnp.sum(zero, dtype=jnp.float32),
        "underflows": jnp.sum(
            ~zero & (scaled < _SMALLEST_SUBNORMAL), dtype=jnp.float32
        ),
        # Written so that NaN counts too.
        "overflows": jnp.sum(~(scaled < _OVERFLOW_THRESHOLD), dtype=jnp.float32),
    }


def _max_keeping_nan(values: jax.Array) -> jax.Array:
    """`max(values)`, NaN if one is (-inf if there are none).

    Not `jnp.max` alone: XLA:CPU's vectorised float32 `max` drops a NaN (from 4097
    elements), and so does the all-reduce that combines a sharded array's maxima.
    """
    largest = jnp.max(values, initial=-jnp.inf)
    return jnp.where(jnp.any(jnp.isnan(values)), jnp.nan, largest)


def _figures(counts: dict[str, Any], scale: jax.Array) -> dict[str, jax.Array]:
    size = jnp.maximum(counts["size"], 1.0)
    max_abs = jnp.maximum(counts["max_abs"], 0.0)
    return {
        "max_abs": max_abs,
        "zero_fraction": counts["zeros"] / size,
        "underflow_fraction": counts["underflows"] / size,
        "overflow_fraction": counts["overflows"] / size,
        "headroom_bits": jnp.log2(jnp.float32(_FLOAT16.max) / (max_abs * scale)),
    }


def _scale_to_evaluate_at(loss_scale: Any) -> jax.Array:
    if loss_scale is None:
        return jnp.ones([], jnp.float32)
    found = lookup.scale_to_evaluate_at(loss_scale, "loss_scale", "grad_stats")
    if not validation.is_number(found):
        return jnp.asarray(found.scale, jnp.float32)
    # A concrete number is checked here; a traced one (or a device array, which
    # would need a sync to read) is taken as given.
    if isinstance(found, numbers.Real | np.generic) and not (
        0 < float(found) < float("inf")
    ):
        raise ValueError(
            "`loss_scale` of `grad_stats` must be positive and finite (the scale"
            f" to evaluate at), got {found!r}; None evaluates at 1."
        )
    return jnp.asarray(found, jnp.float32)


def metrics(opt_state_or_loss_scale: Any) -> dict[str, jax.Array]:
    """Returns a dict of scalar arrays describing the loss-scale state, for logging.

    Usable inside `jax.jit`: the values are arrays, nothing is copied to the host.

    Args:
      opt_state_or_loss_scale: a loss-scale state, or any pytree holding exactly
        one (an optimizer state, a `TrainState`, a `lossscale.flax.Optimizer`).

    Returns:
      A dict with the same keys for every kind of loss scale:

      * `loss_scale`: float32, the current scale;
      * `skipped_steps`: int32, non-finite (skipped) steps in total;
      * `forward_overflows`: int32, skipped steps whose loss (`value=`) was not finite;
      * `backward_overflows`: int32, skipped steps with a finite loss;
      * `consecutive_skips`: int32, non-finite steps in a row up to the latest;
      * `last_finite`: bool, whether the latest step was applied;
      * `stuck`: bool, the latest step overflowed backward at `min_scale`;
      * `overflow_leaf`: int32, the index in `jax.tree.leaves(grads)` of the first
        non-finite gradient of the latest skipped step, or -1; `leaf_path` names it.

    Raises:
      TypeError: if given a spec (a number, "dynamic" or None) or the optimizer.
      ValueError: if no loss-scale state, or more than one, is found.

    Examples:
      >>> import jax.numpy as jnp, optax, lossscale
      >>> opt_state = lossscale.wrap(optax.sgd(0.1)).init(jnp.zeros(3))
      >>> for name, value in lossscale.metrics(opt_state).items():
      ...     print(name, value)
      loss_scale 32768.0
      skipped_steps 0
      forward_overflows 0
      backward_overflows 0
      consecutive_skips 0
      last_finite True
      stuck False
      overflow_leaf -1
    """
    state = lookup.find(opt_state_or_loss_scale, "opt_state_or_loss_scale")
    # `jnp.asarray` unwraps containers such as the variables of `nnx.Optimizer`.
    skipped_steps = jnp.asarray(state.skipped_steps)
    forward_overflows = jnp.asarray(state.forward_overflows)
    return {
        "loss_scale": jnp.asarray(state.scale),
        "skipped_steps": skipped_steps,
        "forward_overflows": forward_overflows,
        "backward_overflows": skipped_steps - forward_overflows,
        "consecutive_skips": jnp.asarray(state.consecutive_skips),
        "last_finite": was_applied(state),
        "stuck": jnp.asarray(state.stuck),
        "overflow_leaf": jnp.asarray(state.overflow_leaf),
    }
