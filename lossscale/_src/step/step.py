"""The guarded step: check the gradients, then apply or skip the step.

`wrap`, `apply_gradients`, `lossscale.flax.TrainState` and `lossscale.flax.Optimizer`
(through `wrap`) all run `guarded_step`. Its data flow: Flax's fp8 collection is
split off at its entry and merged back at its exit; the gradients go through the
check (`finite`) and, on an applied step, the unscaling (`unscaling`) into the
optimizer's update; the loss-scale state moves last (`update`). Why each choice:
`docs/design.md`, "The step".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from lossscale._src import validation
from lossscale._src.state import update
from lossscale._src.state.kind import LossScale
from lossscale._src.step import finite
from lossscale._src.step import fp8
from lossscale._src.step import sides
from lossscale._src.step import unscaling


class StepOptions(NamedTuple):
    """The settings of a guarded step, validated once where the step is built."""

    axis_name: validation.AxisName | None
    clip_norm: float | None


def step_options(axis_name: Any, clip_norm: Any) -> StepOptions:
    """Validates `axis_name` and `clip_norm`; raises naming the bad one."""
    return StepOptions(
        validation.validate_axis_name(axis_name),
        validation.validate_clip_norm(clip_norm),
    )


class StepInput(NamedTuple):
    """What a guarded step takes from its entry point."""

    loss_scale: LossScale  # the state the loss was scaled with
    grads: Any  # the gradients of the scaled loss (Flax's fp8 collection too)
    params: Any  # the parameters (the fp8 collection too), or None
    value: Any  # the unscaled loss, or None
    options: StepOptions


class OptimizerInput(NamedTuple):
    """What the optimizer's update gets on an applied step, fp8 split off."""

    grads: Any  # unscaled (and clipped), without Flax's fp8 collection
    params: Any  # without the collection
    carry: Any  # the optimizer state
    fp8_new: Any  # the collection's new values, from the gradients (None: none)
    fp8_old: Any  # its current values, from the parameters (None: none)


class OptimizerOutput(NamedTuple):
    """What the optimizer's update returns."""

    updates: Any  # the updates of the parameters, without the fp8 collection
    carry: Any  # the new optimizer state
    fp8: Any  # the collection's values to write (None: none)


Optimizer = Callable[[OptimizerInput], OptimizerOutput]


class StepResult(NamedTuple):
    """What a guarded step returns."""

    output: Any  # the new parameters (`apply_updates`) or the updates, fp8 merged
    carry: Any  # the new optimizer state, or the old one on a skipped step
    loss_scale: LossScale  # the next state
    applied: jax.Array  # bool scalar, whether the step was applied


def guarded_step(
    inputs: StepInput, optimizer: Optimizer, carry: Any, *, apply_updates: bool
) -> StepResult:
    """One loss-scaled step: check, then apply or skip, then update the state.

    1. Splits Flax's fp8 collection off the gradients and the parameters: it is
       not checked, unscaled, clipped or optimised, and is merged back at the end.
    2. Checks in one pass whether the unscaled gradients are finite and which
       leaf is first not to be (with `clip_norm`, their global norm is the
       check), and whether the loss `value` is; agrees on all three over
       `axis_name`.
    3. Applied: `optimizer` on the unscaled (and clipped) gradients. Skipped:
       `carry` as it was, bit for bit, and negative-zero updates. The updates
       cross the skip, and with `apply_updates` the step adds them to the
       parameters after it, as `wrap`'s caller does. One `lax.cond` on
       XLA:CPU, a select elsewhere (design.md, "The step").
    4. Updates the loss-scale state: the unscaling used the scale the loss was
       multiplied by, the next step uses the new one.

    Args:
      inputs: the loss-scale state, gradients, parameters, loss and options.
      optimizer: the optimizer's update, run on an applied step.
      carry: what a skipped step keeps as it is (the optimizer state).
      apply_updates: whether the step adds the updates to the parameters.

    Returns:
      A `StepResult`.
    """
    loss_scale, options = inputs.loss_scale, inputs.options
    split = fp8.split(inputs.grads, inputs.params)
    validation.validate_gradients(split.grads, split.params)
    validation.refuse_unbound_axis(
        options.axis_name, "the step (`wrap`'s `update`, `apply_gradients`, ...)"
    )
    loss = (
        None
        if inputs.value is None
        else validation.validate_loss(inputs.value, "value")
    )

    def applied_step(grads, params, kept, norm, applied):
        # What an applied step does, traced once below. With `apply_updates` it
        # gives the updates (which the select forms add after the skip, where
        # `wrap`'s caller does) and the parameters with them added (which the
        # CPU form keeps or not): each form takes its own, and the rest is dead.
        carry, old = kept if apply_updates else (kept, split.old)
        grads = unscaling.unscale(grads, loss_scale, params)
        if options.clip_norm is not None:
            grads = unscaling.clip_to_norm(grads, norm, options.clip_norm)
        new = optimizer(OptimizerInput(grads, params, carry, split.new, old))
        if apply_updates:  # the fp8 values are kept by a skipped step too
            # -0.0 that XLA cannot see in the cond's branch (`_unfused`); the select
            # forms give a constant `True`, and XLA folds the add away.
            updates = _unfused(new.updates, jnp.where(applied, -0.0, 0.0))
            added = optax.apply_updates(params, updates)
            return (updates, added), (new.carry, new.fp8)
        # The fp8 values as what `optax.apply_updates` adds to the old ones.
        return (new.updates, fp8.differences(new.fp8, old)), new.carry

    values = unscaling.values_to_check(split.grads, loss_scale, split.params)
    checked = finite.check(
        values,
        loss_scale,
        loss=loss,
        axis_name=options.axis_name,
        norm=options.clip_norm is not None,
    )
    # Behind a barrier, XLA:GPU's fusion does not weigh fusing the check into each
    # of the thousands of ops that read its outcome (design.md, "The step").
    applied, norm = jax.lax.optimization_barrier(
        (checked.grads_finite & checked.loss_finite, checked.norm)
    )
    kept = (carry, split.old) if apply_updates else carry
    operands = (split.grads, split.params, kept, norm, applied)
    # Jitted once: every form calls it, and jit traces optax's Python once; the
    # kind of each of its outputs is read while it is (`sides.kinds`).
    jitted = jax.jit(applied_step)
    shapes, kinds = sides.kinds(jitted, *operands)
    validation.refuse_changed_types(shapes[1], kept)

    def skipped(params, kept):
        """What a skipped step gives, in the applied step's tree."""
        if apply_updates:
            return (_negative_zeros(shapes[0][0]), params), kept
        return _negative_zeros(shapes[0]), kept

    def cond(grads, params, kept, norm, applied):
        # Every update of the step inside one `lax.cond`: a skipped step runs
        # nothing of it; with `apply_updates`, the parameters are added there.
        operands = (grads, params, kept, norm, applied)
        # The two sides of the skip made one type (a select does it itself).
        joined = sides.join(kinds, jax.tree.map(sides.kind, skipped(params, kept)))

        def on_applied(operands):
            return sides.cast(jitted(*operands), joined)

        def on_skipped(operands):
            return sides.cast(skipped(operands[1], operands[2]), joined)

        given = jax.lax.cond(applied, on_applied, on_skipped, operands)
        return (given[0][1], given[1]) if apply_updates else given  # added, kept

    def select(grads, params, kept, norm, _):
        # A select per output; the updates added after it, as `wrap`'s caller
        # does (`p + (-0.0)` is `p`, bit for bit).
        new = jitted(grads, params, kept, norm, True)
        stays = skipped(params, kept)
        if apply_updates:  # the parameters added to after the select, not before
            ((new, _), new_kept), ((stays, _), kept) = new, stays
            new, stays = (new, new_kept), (stays, kept)
        given = jax.tree.map(lambda n, s: jax.lax.select(applied, n, s), new, stays)
        if apply_updates:  # the updates added, and kept
            return optax.apply_updates(params, given[0]), given[1]
        return given

    output, new_kept = finite.per_backend(*operands, cpu=cond, gpu=select, tpu=select)
    if apply_updates:
        tree, (carry, collection) = output, new_kept
    else:
        (tree, collection), carry = output, new_kept
    loss_scale = update.next_state(
        loss_scale, checked.grads_finite, checked.loss_finite, checked.first
    )
    return StepResult(fp8.merge(tree, collection), carry, loss_scale, applied)


def _unfused(tree: Any, zero: jax.Array) -> Any:
    """`tree`'s values, kept out of an FMA with whatever they are added to next.

    XLA:CPU fuses an add into the multiply before it as one rounding (an FMA),
    so `p + u` gives other bits where `u` is computed in the add's kernel than
    where it was written out first. `zero + u`, with `zero` a -0.0 known only at
    run time, is `u` for every `u`, and it is that add the multiply fuses into:
    the add of `u` to `p` then rounds alone, whatever XLA fuses (design.md,
    "Where the update crosses the skip").
    """

    # `lax`, not `jnp`: an operation or two per leaf of the step's trace. `zero`
    # first: XLA:CPU then compiles one kernel for the leaves of a shape, where
    # `u + zero` gave the first of them a kernel of its own (design.md).
    def rounded(u):
        if u is None or not jnp.issubdtype(u.dtype, jnp.inexact):
            return u
        if jnp.issubdtype(u.dtype, jnp.complexfloating):
            z = jax.lax.convert_element_type(zero, jax.lax.real(u).dtype)
            return jax.lax.complex(
                jax.lax.add(z, jax.lax.real(u)), jax.lax.add(z, jax.lax.imag(u))
            )
        return jax.lax.add(jax.lax.convert_element_type(zero, u.dtype), u)

    return jax.tree.map(rounded, tree, is_leaf=lambda x: x is None)


def _negative_zeros(shapes: Any) -> Any:
    """What a skipped step's updates are, per leaf: `p + (-0.0)` is `p`, bit for bit.

    A complex one's parts both: `-0.0 + 0.0` is `+0.0`.
    """

    def zeros(s):
        complex_ = jnp.issubdtype(s.dtype, jnp.complexfloating)
        return jax.lax.full(s.shape, complex(-0.0, -0.0) if complex_ else -0.0, s.dtype)

    return jax.tree.map(zeros, shapes)
