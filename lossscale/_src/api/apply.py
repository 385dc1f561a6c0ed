"""The whole optimizer step in one call: unscale, update and apply, or skip."""

from __future__ import annotations

from typing import Any
from typing import cast

import jax
import optax

from lossscale._src import validation
from lossscale._src.api import lookup
from lossscale._src.state.kind import LossScale
from lossscale._src.state.kind import LossScaleT
from lossscale._src.step import fp8
from lossscale._src.step import step


@validation.by_keyword(
    1,
    "`lossscale.apply_gradients(tx, grads=grads, params=params,"
    " opt_state=opt_state, loss_scale=loss_scale)`",
)
def apply_gradients(
    tx: optax.GradientTransformation,
    *,
    grads: Any,
    params: Any,
    opt_state: optax.OptState,
    loss_scale: LossScaleT,
    value: jax.typing.ArrayLike | None = None,
    axis_name: validation.AxisName | None = None,
    clip_norm: float | None = None,
    **extra_args: Any,
) -> tuple[Any, optax.OptState, LossScaleT]:
    """Applies the gradients of a scaled loss with `tx`, or skips the step.

    The functional form of `lossscale.flax.TrainState.apply_gradients`: what
    `lossscale.wrap(tx)` and `optax.apply_updates` do, bit for bit, in one step. A
    step is applied when every unscaled gradient, and `value` if given, is finite;
    otherwise `params` and `opt_state` come back unchanged, bit for bit.

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
      tx: the optax optimizer, not wrapped with `lossscale.wrap`.
      grads: the gradients of the *scaled* loss, with the tree of `params`.
      params: the parameters (with Flax fp8 layers, the whole variables dict).
      opt_state: `tx.init(params)` (without the fp8 collection, if any).
      loss_scale: the loss-scale state, carried from step to step.
      value: the unscaled loss, optional (a forward overflow if not finite).
      axis_name: as in `lossscale.wrap`.
      clip_norm: as in `lossscale.wrap`.
      **extra_args: extra arguments for `tx.update`.

    Returns:
      `(params, opt_state, loss_scale)`, the next ones.

    Raises:
      TypeError: if an argument has the wrong type, `params` holds a loss-scale
        state, a gradient is not floating point, or `tx.update` changes the
        dtype of a state leaf.
      ValueError: if `grads` and `params` differ in tree, `clip_norm` is out of
        range, `opt_state` holds a loss-scale state (`tx` is wrapped already)
        or has another tree than `tx.init(params)`, or Flax fp8 variables meet
        an `optax.MultiSteps` state (use `wrap(optax.MultiSteps(...))`).

    Examples:
      >>> import jax.numpy as jnp, optax, lossscale
      >>> tx, params = optax.sgd(0.25), jnp.array(1.0)
      >>> loss_scale = lossscale.DynamicLossScale()
      >>> loss, grads = lossscale.value_and_grad(lambda p: p**2)(loss_scale, params)
      >>> params, opt_state, loss_scale = lossscale.apply_gradients(
      ...     tx, grads=grads, params=params, opt_state=tx.init(params),
      ...     loss_scale=loss_scale, value=loss)
      >>> print(params, loss_scale.skipped_steps)
      0.5 0
    """
    validation.validate_transformation(tx, "tx")
    if not isinstance(loss_scale, LossScale):
        got = (
            f"the class `{loss_scale.__name__}` (pass an instance)"
            if isinstance(loss_scale, type)
            else type(loss_scale).__name__
        )
        raise TypeError(
            "`loss_scale` must be a loss-scale state (e.g."
            " `lossscale.DynamicLossScale()`), carried from step to step, got"
            f" {got}. (A number or 'dynamic' would start afresh every step.)"
        )
    options = step.step_options(axis_name, clip_norm)
    lookup.refuse_in_params(params, "`apply_gradients`")
    lookup.refuse_wrapped(opt_state, "opt_state", "`apply_gradients`")
    fp8.refuse_accumulation(params, opt_state, "`apply_gradients`")
    if value is not None:
        extra_args["value"] = value
    try:
        result = step.guarded_step(
            step.StepInput(loss_scale, grads, params, value, options),
            optimizer_update(tx, extra_args),
            opt_state,
            apply_updates=True,
        )
    except Exception:
        # Checked only now: tracing `tx.init` costs as much as the step.
        _refuse_foreign_state(tx, params, opt_state)
        raise
    # Of `loss_scale`'s kind: `lossscale.update` moved it.
    return result.output, result.carry, cast(LossScaleT, result.loss_scale)


def _refuse_foreign_state(tx: optax.GradientTransformation, params, opt_state):
    """Raises if `opt_state` has another tree than `tx.init(params)`."""
    trainable = fp8.trainable(params)
    try:
        expected = jax.eval_shape(tx.init, trainable)
    except Exception:  # the step's own error says more
        return
    if jax.tree.structure(expected) == jax.tree.structure(opt_state):
        return
    if trainable is not params:
        raise ValueError(
            f"`params` holds Flax's fp8 `{fp8.OVERWRITE}` collection, which"
            " no optimizer sees: build `opt_state` with `tx.init` of the other"
            " collections, e.g. `tx.init({k: v for k, v in params.items() if"
            f" k != '{fp8.OVERWRITE}'}})`."
        ) from None
    raise ValueError(
        "`opt_state` must be `tx.init(params)` (then each step's new one), got"
        f" a tree that differs from it: {_first_difference(opt_state, expected)}."
        " Another optimizer's state, or one built for other parameters?"
    ) from None


def optimizer_update(tx: optax.GradientTransformation, extra_args: dict) -> Any:
    """`tx.update` as a guarded step runs it: the optimizer of `apply_gradients`.

    Flax's fp8 collection takes its new values (`fp8.written`). Shared with
    `lossscale.flax.TrainState`.
    """
    if extra_args:
        tx = optax.with_extra_args_support(tx)

    def update(given: step.OptimizerInput) -> step.OptimizerOutput:
        updates, opt_state = tx.update(
            given.grads, given.carry, given.params, **extra_args
        )
        written = fp8.written(given.fp8_new, given.fp8_old)
        return step.OptimizerOutput(updates, opt_state, written)

    return update


def _first_difference(got: Any, expected: Any) -> str:
    # Key paths, not the tree definitions: those of a model fill pages.
    paths = [
        [jax.tree_util.keystr(path) for path, _ in jax.tree.leaves_with_path(tree)]
        for tree in (got, expected)
    ]
    for have, want in zip(*paths, strict=False):
        if have != want:
            return f"a leaf at `opt_state{have}` where `tx.init(params)` has `{want}`"
    if len(paths[0]) != len(paths[1]):
        return f"{len(paths[0])} leaves where `tx.init(params)` has {len(paths[1])}"
    return (
        f"the same leaves in other containers ({type(got).__name__} where"
        f" `tx.init(params)` gives {type(expected).__name__})"
    )
