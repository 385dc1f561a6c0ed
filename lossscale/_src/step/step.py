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
import jax.extend.core as jcore
import jax.numpy as jnp
import optax

from lossscale._src import checks
from lossscale._src.state import update
from lossscale._src.state.kind import LossScale
from lossscale._src.step import finite
from lossscale._src.step import fp8
from lossscale._src.step import split as split_step
from lossscale._src.step import unscaling


class StepOptions(NamedTuple):
    """The settings of a guarded step, validated once where the step is built."""

    axis_name: checks.AxisName | None
    clip_norm: float | None


def step_options(axis_name: Any, clip_norm: Any) -> StepOptions:
    """Validates `axis_name` and `clip_norm`; raises naming the bad one."""
    return StepOptions(
        checks.validate_axis_name(axis_name), checks.validate_clip_norm(clip_norm)
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
       parameters after it, as `wrap`'s caller does. A `lax.cond` on XLA:CPU,
       a select elsewhere (`split`).
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
    checks.validate_gradients(split.grads, split.params)
    checks.refuse_unbound_axis(
        options.axis_name, "the step (`wrap`'s `update`, `apply_gradients`, ...)"
    )
    loss = None if inputs.value is None else checks.validate_loss(inputs.value, "value")

    def applied_step(grads, params, kept, norm, zero):
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
            updates = _rounded(new.updates, zero)
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
    # -0.0 on an applied step, which the CPU form's cond reads as a value XLA
    # cannot see (`_rounded`); the select forms get a constant, which XLA folds
    # away with its adds.
    zero = jnp.where(applied, jnp.float32(-0.0), jnp.float32(0.0))
    operands = (split.grads, split.params, kept, norm, zero)
    # Traced once: each backend's form is built from its jaxpr (`split`).
    jitted = jax.jit(applied_step)
    traced, shapes = jax.make_jaxpr(jitted, return_shape=True)(*operands)
    checks.refuse_changed_types(shapes[1], kept)
    inner = _inner(traced)
    leaves = jax.tree.leaves(operands)
    # The outputs each form takes, by position, with what a skipped step gives
    # for each: the input at that position of the step's inputs (its constants
    # first), or negative zeros (the updates) where None.
    grads_count, params_count, kept_count = (
        len(jax.tree.leaves(tree)) for tree in operands[:3]
    )
    first = len(jax.tree.leaves(shapes[0]))
    params_at = len(inner.consts) + grads_count
    kept_at = params_at + params_count
    carried = [(first + j, kept_at + j) for j in range(kept_count)]
    updates = [(k, None) for k in range(len(jax.tree.leaves(shapes[0][0])))]
    if apply_updates:  # the parameters with the updates added follow them
        added = [(len(updates) + j, params_at + j) for j in range(params_count)]
    else:
        updates = [(k, None) for k in range(first)]  # the fp8 differences too

    def select(*leaves):
        values = [*inner.consts, *leaves[:-1], jnp.float32(-0.0)]  # a constant
        given = split_step.select(inner, values, applied, updates + carried)
        if not apply_updates:
            return given
        new = jax.tree.unflatten(
            jax.tree.structure(shapes[0][0]), given[: len(updates)]
        )
        params = jax.tree.unflatten(
            jax.tree.structure(split.params),
            leaves[grads_count : grads_count + params_count],
        )
        return [
            *jax.tree.leaves(optax.apply_updates(params, new)),
            *given[len(updates) :],
        ]

    def conds(*leaves):
        return split_step.conds(
            inner,
            [*inner.consts, *leaves],
            applied,
            (added if apply_updates else updates) + carried,
        )

    flat = finite.per_backend(*leaves, cpu=conds, gpu=select, tpu=select)
    if apply_updates:
        tree = jax.tree.unflatten(jax.tree.structure(split.params), flat[:params_count])
        carry, collection = jax.tree.unflatten(
            jax.tree.structure(shapes[1]), flat[params_count:]
        )
    else:
        (tree, collection), carry = jax.tree.unflatten(jax.tree.structure(shapes), flat)
    loss_scale = update.next_state(
        loss_scale, checked.grads_finite, checked.loss_finite, checked.first
    )
    return StepResult(fp8.merge(tree, collection), carry, loss_scale, applied)


def _rounded(tree: Any, zero: jax.Array) -> Any:
    """`tree`'s values, each rounded on its own wherever it is added to another.

    XLA:CPU fuses an add into the multiply before it as one rounding (an FMA),
    so `p + u` gives other bits where `u` is computed in the add's kernel than
    where it was written out first. `u + zero`, with `zero` a -0.0 known only at
    run time, is `u` for every `u`, and it is that add the multiply fuses into:
    the add of `u` to `p` then rounds alone, whatever XLA fuses (design.md,
    "Where the update crosses the skip").
    """

    def rounded(u):
        if u is None or not jnp.issubdtype(u.dtype, jnp.inexact):
            return u
        z = zero.astype(jnp.real(u).dtype)
        if jnp.iscomplexobj(u):
            return jax.lax.complex(jnp.real(u) + z, jnp.imag(u) + z)
        return u + z

    return jax.tree.map(rounded, tree, is_leaf=lambda x: x is None)


def _inner(closed: Any) -> Any:
    """The jaxpr of the jitted step that `closed` calls, as a jaxpr of its inputs.

    What the step closes over (the loss-scale state, ...) becomes its constants.
    """
    (call,) = closed.jaxpr.eqns
    inner = call.params["jaxpr"]
    by_outer = dict(zip(call.invars, inner.jaxpr.invars, strict=True))
    consts = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
    if call.outvars != closed.jaxpr.outvars or len(by_outer) != len(call.invars):
        return closed  # pragma: no cover - no jax gives this: the call as it is
    constvars = [by_outer[v] for v in consts if v in by_outer]
    jaxpr = jcore.Jaxpr(
        (*constvars, *inner.jaxpr.constvars),
        [by_outer[v] for v in closed.jaxpr.invars],
        inner.jaxpr.outvars,
        inner.jaxpr.eqns,
        inner.jaxpr.effects,
        inner.jaxpr.debug_info,
    )
    return jcore.ClosedJaxpr(
        jaxpr, [consts[v] for v in consts if v in by_outer] + list(inner.consts)
    )
