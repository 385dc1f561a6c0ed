"""The optax wrapper: unscale, check, skip non-finite steps, update the scale."""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from lossscale._src import validation
from lossscale._src.api import lookup
from lossscale._src.state import spec
from lossscale._src.state.kind import LossScale
from lossscale._src.step import fp8
from lossscale._src.step import step


class WrapState(NamedTuple):
    """State of the `optax.GradientTransformationExtraArgs` returned by `wrap`.

    Attributes:
      loss_scale: the loss-scale state (a `LossScale` pytree of scalar arrays).
      inner_state: the wrapped transformation's state; unchanged, bit for bit, by a
        skipped step.
      pending_overwrite: None, except when Flax fp8 metadata is trained through a
        wrapped `optax.MultiSteps`: their elementwise max over the micro-steps of
        the current accumulation, written when the inner optimizer steps.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import lossscale
      >>> opt_state = lossscale.wrap(optax.adam(1e-3), 256.0).init(jnp.zeros(2))
      >>> print(type(opt_state).__name__, opt_state.loss_scale.scale)
      WrapState 256.0
      >>> print(opt_state.inner_state[0].count)
      0
    """

    loss_scale: LossScale
    inner_state: optax.OptState
    pending_overwrite: Any = None


def wrap(
    inner: optax.GradientTransformation,
    loss_scale: spec.StateOrSpec = "dynamic",
    *,
    axis_name: validation.AxisName | None = None,
    clip_norm: float | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optax transformation with loss scaling.

    The returned transformation's `update` takes the gradients of the *scaled* loss
    (`lossscale.scale_loss`). Each step checks, in one pass, whether the unscaled
    gradients are finite; it then either runs `inner.update` on them (divided by the
    scale, into the parameters' dtype) or skips: negative-zero updates, which leave
    every parameter bit as it is, and the inner state untouched. Then
    `lossscale.update` moves the loss-scale state. Every kind skips
    non-finite steps; `update(..., value=loss)` tells forward from backward
    overflows. It composes with `optax.chain` and `optax.inject_hyperparams`, and
    accumulates as `wrap(optax.MultiSteps(inner, k))`; `optax.MultiSteps(wrap(...))`
    is refused at `init` (`docs/guides/wrap.md`; the why: `docs/design.md`).

    **Exactness.** On XLA:CPU the skip is a `lax.cond`: a skipped step runs nothing of
    the update (a callback in it does not fire, a loop over the gradients does not run)
    and returns the parameters and the optimizer state bit for bit; with nothing to
    unscale (`loss_scale=None`, or a static scale of 1), `wrap(tx)` gives bit for bit
    what `tx.update` gives run inside one `lax.cond` on the gradients in their
    parameters' dtypes (a float16 gradient of a float32 parameter as float32); and
    `apply_gradients` and `TrainState.apply_gradients` give bit for bit what `wrap(tx)`
    followed by `optax.apply_updates` gives (Flax's fp8 metadata aside, which `wrap`
    writes as a difference: to within one float32 rounding). On GPUs and TPUs the skip
    is a select: a skipped step returns the same bits, but the update runs and is thrown
    away (a callback in it fires, a loop over the gradients runs on their infs and
    NaNs), and `apply_gradients` compiles to the program of `wrap(tx)` followed by
    `optax.apply_updates` (the same bits, unless the rest of the two programs makes XLA
    fuse them otherwise).

    Args:
      inner: the optax transformation (an `optax.MultiSteps` counts micro-steps).
      loss_scale: a loss-scale state, a number (static), `"dynamic"` or `None`.
      axis_name: inside `shard_map`/`pmap`, the mapped axis (or a tuple of them)
        that the decision is agreed over, in one scalar collective.
      clip_norm: None, or clip the unscaled gradients to this global norm before
        `inner`, as `optax.clip_by_global_norm` would, in the check's pass.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a `WrapState`.

    Raises:
      TypeError: if an argument has the wrong type; `init` and `update`, if
        `params` holds a loss-scale state; `update`, for gradients that are not
        floating point.
      ValueError: if `loss_scale` or `clip_norm` is out of range; `init`, if
        `inner` is wrapped already or an `optax.MultiSteps` holds the wrap;
        `update`, for gradients whose tree differs from `params`.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, lossscale
      >>> tx = lossscale.wrap(optax.sgd(0.25))
      >>> params = jnp.array(1.0)
      >>> opt_state = tx.init(params)
      >>> grads = jax.grad(lambda p: lossscale.scale_loss(p**2, opt_state))(params)
      >>> updates, opt_state = tx.update(grads, opt_state, params)
      >>> print(optax.apply_updates(params, updates))
      0.5
    """
    inner, accumulates = prepared(inner)
    template = spec.from_spec(loss_scale)
    options = step.step_options(axis_name, clip_norm)

    def init_fn(params):
        if _initialised_by_multisteps():
            fp8_metadata = fp8.split_off(params, "params")[1]
            raise ValueError(
                MULTISTEPS_OUTSIDE if fp8_metadata is None else fp8.ACCUMULATED_OUTSIDE
            )
        return initial_state(inner, template, params, accumulates=accumulates)

    def update_fn(updates, state, params=None, *positional, **extra_args):
        if positional:
            raise TypeError(
                "`update` takes the gradients, the state and the parameters by"
                f" position, and the rest by keyword; got {len(positional)} more"
                " positional argument(s). Pass the loss as `value=`:"
                " `tx.update(grads, opt_state, params, value=loss)`."
            )
        if not isinstance(state, WrapState):
            raise TypeError(
                "`state` must be the `WrapState` returned by this transformation's"
                f" `init`, got {type(state).__name__}."
            )
        spec.validate_state(state.loss_scale, "state.loss_scale")
        lookup.refuse_in_params(params, "`update`")

        def inner_update(given: step.OptimizerInput) -> step.OptimizerOutput:
            inner_state, pending = given.carry
            updates, inner_state = inner.update(
                given.grads, inner_state, given.params, **extra_args
            )
            if given.fp8_old is None or pending is None:
                written = fp8.written(given.fp8_new, given.fp8_old)
            else:  # accumulating: written when `optax.MultiSteps` emits
                written, pending = fp8.accumulated(
                    pending, given.fp8_new, given.fp8_old, inner_state.mini_step == 0
                )
            return step.OptimizerOutput(updates, (inner_state, pending), written)

        result = step.guarded_step(
            step.StepInput(
                state.loss_scale, updates, params, extra_args.get("value"), options
            ),
            inner_update,
            (state.inner_state, state.pending_overwrite),
            apply_updates=False,
        )
        return result.output, WrapState(result.loss_scale, *result.carry)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


MULTISTEPS_OUTSIDE = (
    "`optax.MultiSteps(lossscale.wrap(...))` is refused: optax's MultiSteps resets"
    " its accumulators as `(1 - emit) * acc`, so one non-finite micro-batch (0 * NaN"
    " is NaN) skips every later cycle while the scale collapses. Accumulate inside"
    " the wrap: `lossscale.wrap(optax.MultiSteps(inner, k))` checks each"
    " micro-batch, drops a non-finite one and backs off at once. With a framework"
    " that adds the MultiSteps itself (tunix's `gradient_accumulation_steps`, or"
    " its RL mini- and micro-batch sizes), use `lossscale.tunix`."
)


def _initialised_by_multisteps() -> bool:
    """Whether `optax.MultiSteps.init` is what initialises the calling wrap.

    `MultiSteps(wrap(...))` is refused at `init`, before a step has run: its
    accumulators keep a NaN for good (with Flax's fp8 collection, it would also
    average the metadata). Found from the caller's frames: the wrap cannot see
    what holds it otherwise.
    """
    # The whole stack: chains, masks and partitions nest to any depth between.
    frame: FrameType | None = sys._getframe(2)  # wrap's `init`'s caller
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), optax.MultiSteps):
            return True
        frame = frame.f_back
    return False


def prepared(inner: Any) -> tuple[Any, bool]:
    """`inner` as `wrap` runs it (extra arguments supported); whether it accumulates.

    Raises `TypeError` unless `inner` is an optax transformation.
    """
    accumulates = isinstance(inner, optax.MultiSteps)
    if accumulates:
        inner = inner.gradient_transformation()
    validation.validate_transformation(inner, "inner")
    return optax.with_extra_args_support(inner), accumulates


def initial_state(
    inner: Any, template: LossScale, params: Any, *, accumulates: bool
) -> WrapState:
    """What `wrap(inner, template).init(params)` returns, whatever holds the wrap.

    `inner` is ready (extra arguments supported; an `optax.MultiSteps` as its
    gradient transformation, with `accumulates`).
    """
    lookup.refuse_in_params(params, "`init`")
    trainable, fp8_metadata = fp8.split_off(params, "params")
    inner_state = inner.init(trainable)
    lookup.refuse_wrapped(inner_state, "inner", "`lossscale.wrap`")
    # Under accumulation, fp8 metadata combine with max until the inner
    # optimizer steps (design.md, "fp8 metadata").
    pending = None
    if accumulates and fp8_metadata is not None:
        pending = fp8.unproduced_like(fp8_metadata)
    # Fresh buffers on every call, so the state is safe to donate.
    return WrapState(fresh_copy(template), inner_state, pending)


def fresh_copy(state: LossScale) -> LossScale:
    """`state` with new buffers: safe to donate without touching the original."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), state)
