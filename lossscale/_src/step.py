"""The guarded step: check the gradients, then apply or skip under one `lax.cond`.

`wrap`, `apply_gradients`, `lossscale.flax.TrainState` and
`lossscale.flax.Optimizer` (through `wrap`) all run `guarded_step`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from lossscale._src import checks
from lossscale._src import numerics
from lossscale._src.update import update
from lossscale._src.base import LossScale


def guarded_step(
    loss_scale: LossScale,
    grads: Any,
    params: Any,
    value: Any,
    options: checks.StepOptions,
    applied_step: Callable[[Any, Any], tuple[Any, Any]],
    carry: Any,
) -> tuple[Any, Any, LossScale, jax.Array]:
    """One loss-scaled step.

    1. Checks, in one pass over `grads`, whether the unscaled gradients are all
       finite (with `clip_norm`, their global norm is the check), and whether
       the loss `value` is (when given); agrees on both over `axis_name`.
    2. Under one `jax.lax.cond`: either `applied_step(unscaled_grads, carry)`,
       returning `(output, new_carry)`, where the unscaling (and clipping) fuses
       into the step; or the skip, returning negative zeros shaped like `output`
       (`p + (-0.0)` is `p` bit for bit) and `carry` untouched. Flax's fp8
       collection is split off by the caller (`fp8.split`) before: it takes no
       part in the check or the unscaling.
    3. Updates the loss-scale state: the unscaling used the scale the loss was
       multiplied by, the next step uses the new one.

    Args:
      loss_scale: the current loss-scale state.
      grads: the gradients of the scaled loss, checked here.
      params: the parameters (their dtypes decide the unscaled dtypes), or None.
      value: the unscaled loss, or None.
      options: `axis_name` and `clip_norm`, checked where the step was built.
      applied_step: the step on the unscaled gradients.
      carry: what a skipped step returns as it is (the optimizer state).

    Returns:
      `(output, carry, loss_scale, applied)`.
    """
    checks.check_gradients(grads, params)
    grads_finite, loss_finite, norm, checked = _finite_flags(
        grads, params, loss_scale, value, options
    )
    applied = grads_finite & loss_finite

    # The skip must match the applied branch's output types: the step may change
    # dtypes (float16 gradients, float32 updates), which is where
    # `optax.apply_if_finite` fails. `lax.cond` traces the applied branch first,
    # which records them; otherwise (another JAX) the skip traces it once more.
    applied_types = []

    def apply_branch(operands):
        grads, carry = operands
        grads = numerics.unscale(grads, loss_scale, params)
        if options.clip_norm is not None:
            grads = numerics.clip_to_norm(grads, norm, options.clip_norm)
        result = applied_step(grads, carry)
        # From the abstract values: `ShapeDtypeStruct.like` of a tracer asks for
        # its sharding, which costs a walk of the whole trace per leaf.
        applied_types.append(
            jax.tree.map(lambda x: jax.ShapeDtypeStruct.like(jax.typeof(x)), result)
        )
        return result

    def skip_branch(operands):
        if not applied_types:
            jax.eval_shape(apply_branch, operands)
        output_types, carry_types = applied_types[-1]
        checks.check_same_types(carry_types, operands[1])
        # `full_like` of the applied types also keeps their `shard_map` typing
        # (which mapped axes the values vary over).
        zeros = jax.tree.map(lambda t: jnp.full_like(t, -0.0), output_types)
        # Where it overflowed: the first leaf the check flagged. With
        # `clip_norm` the norm was the check, so the flags are computed here.
        flagged = checked
        if flagged is None:
            flagged = numerics.checked_after_unscaling(operands[0], loss_scale, params)
        leaf = first_everywhere(flagged.first_nonfinite(), options.axis_name)
        return (zeros, operands[1]), leaf + like_applied

    def applied_branch(operands):
        return apply_branch(operands), like_applied - 1  # unused

    # Both branches' index takes `applied`'s `shard_map` typing (the devices it
    # varies over), which the skip's, computed from the same gradients, has too.
    like_applied = jnp.zeros_like(applied, jnp.int32)
    operands = (grads, carry)
    (output, carry), leaf = jax.lax.cond(applied, applied_branch, skip_branch, operands)
    loss_scale = update(loss_scale, grads_finite, loss_finite)
    overflow_leaf = jnp.where(applied, loss_scale.overflow_leaf, leaf)
    return output, carry, loss_scale.replace(overflow_leaf=overflow_leaf), applied


def _finite_flags(
    grads: Any,
    params: Any,
    loss_scale: LossScale,
    value: Any,
    options: checks.StepOptions,
) -> tuple[jax.Array, jax.Array, jax.Array | None, numerics.Checked | None]:
    """Whether the unscaled gradients and the loss are finite; the norm; the check.

    The check's per-leaf flags name the leaf on a skipped step; with `clip_norm`
    the norm is the check, and there are none (None).
    """
    if value is None:
        loss_finite = jnp.asarray(True)
    else:
        loss_finite = jnp.isfinite(checks.check_loss(value, "value"))
    if options.clip_norm is None:
        norm = None
        checked = numerics.checked_after_unscaling(grads, loss_scale, params)
        grads_finite = checked.finite
    else:
        norm = numerics.norm_after_unscaling(grads, loss_scale, params)
        checked = None
        grads_finite = jnp.isfinite(norm)
    grads_finite, loss_finite = agree(
        jnp.stack([grads_finite, loss_finite]), options.axis_name
    )
    return grads_finite, loss_finite, norm, checked


def agree(flags: jax.Array, axis_name: checks.AxisName | None) -> jax.Array:
    """Boolean flags, True only where they hold on every device of `axis_name`.

    Several flags go in one array, so they cost one scalar collective together.
    """
    if axis_name is None:
        return flags
    return jax.lax.pmin(flags.astype(jnp.int32), axis_name) == 1


def first_everywhere(index: jax.Array, axis_name: checks.AxisName | None) -> jax.Array:
    """The smallest leaf index over the devices of `axis_name`; -1 (none) is last."""
    if axis_name is None:
        return index
    none = jnp.iinfo(jnp.int32).max
    first = jax.lax.pmin(jnp.where(index < 0, jnp.int32(none), index), axis_name)
    return jnp.where(first == none, jnp.int32(-1), first)
