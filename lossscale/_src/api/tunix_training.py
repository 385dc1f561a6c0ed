"""tunix integration: its trainers' step with the loss scaled, skipped by lossscale.

tunix's trainers (`PeftTrainer`, the RL `Trainer` of GRPO's actor) own the train
step. `wrap` is the optimizer to give them; `scale_trainer` replaces their step.
tunix has no public hook for it: this reads a private attribute (`_has_aux`) and
takes over `PeftTrainer._train_step`'s role, tested against `TESTED_TUNIX` (other
versions refused). Why each choice: `docs/guides/tunix.md`.
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from lossscale._src import validation
from lossscale._src.api import functional
from lossscale._src.api import tunix_metrics
from lossscale._src.api import wrapper
from lossscale._src.state import spec
from lossscale._src.state.kind import LossScale

# The google-tunix releases this module is tested with (tests/test_tunix.py).
TESTED_TUNIX = ("0.1.7",)
# The keyword the installed step passes to the optimizer's `update`: without it,
# tunix's own step (the plain loss) is running.
_FROM_THE_STEP = "lossscale_tunix_step"


class Transformation(optax.GradientTransformationExtraArgs):
    """`lossscale.wrap(inner, ...)` for tunix: updates only in `scale_trainer`'s step.

    It keeps `inner` and the settings, to accumulate inside the wrap when tunix
    puts an `optax.MultiSteps` around it.
    """

    inner: optax.GradientTransformation
    loss_scale: LossScale
    clip_norm: float | None


def wrap(
    inner: optax.GradientTransformation,
    loss_scale: spec.StateOrSpec = "dynamic",
    *,
    clip_norm: float | None = None,
) -> optax.GradientTransformationExtraArgs:
    """The optimizer to give a tunix trainer that trains in float16.

    `lossscale.wrap(inner, loss_scale, clip_norm=clip_norm)`, made for a
    framework that owns the train step: pass it as `PeftTrainer`'s `optimizer`
    (or `RLTrainingConfig(actor_optimizer=...)`), then call
    `scale_trainer(trainer)`. Its `update` refuses to run from tunix's own
    step, which would differentiate the unscaled loss: every update would be
    `loss_scale` times too small, and nothing else would show it.

    Args:
      inner: the optax optimizer, not wrapped.
      loss_scale: as in `lossscale.wrap`: a state, a number, "dynamic" or None.
      clip_norm: as in `lossscale.wrap`: clip the unscaled gradients to this
        global norm in the check's pass.

    Returns:
      An `optax.GradientTransformationExtraArgs`.

    Raises:
      TypeError, ValueError: as `lossscale.wrap`.

    Examples:
      >>> import optax, lossscale.tunix
      >>> tx = lossscale.tunix.wrap(optax.adamw(1e-5), "dynamic")
      >>> print(tx.inner is not None, tx.loss_scale.scale)
      True 32768.0
    """
    plain = wrapper.wrap(inner, loss_scale, clip_norm=clip_norm)
    ready, accumulates = wrapper.prepared(inner)
    template = spec.from_spec(loss_scale)

    def init_fn(params: Any) -> wrapper.WrapState:
        # Not `plain.init`: tunix puts an `optax.MultiSteps` around it, which
        # `wrap` refuses; `scale_trainer` accumulates inside the wrap instead.
        return wrapper.initial_state(ready, template, params, accumulates=accumulates)

    def update_fn(updates, state, params=None, **extra_args):
        if not extra_args.pop(_FROM_THE_STEP, False):
            raise TypeError(
                "This optimizer is `lossscale.tunix.wrap`'s, and tunix's own train"
                " step called it: that step differentiates the unscaled loss, so"
                " every update would be the loss scale times too small. Call"
                " `lossscale.tunix.scale_trainer(trainer)` once after building the"
                " trainer (for GRPO, `rl_cluster.actor_trainer`, after the learner)."
            )
        return plain.update(updates, state, params, **extra_args)

    transformation = Transformation(init_fn, update_fn)
    transformation.inner = inner
    transformation.loss_scale = template
    transformation.clip_norm = validation.validate_clip_norm(clip_norm)
    return transformation


def scale_trainer(trainer: Any) -> Any:
    """Makes a tunix trainer scale its loss: its step, metrics and accumulation.

    The trainer's optimizer must be `lossscale.tunix.wrap(tx)`. Its train step
    becomes: the loss (tunix's `loss_fn`, through `gen_model_input_fn`)
    multiplied by the optimizer's current scale and differentiated; the
    optimizer's update with `value=loss`, which applies the step or skips it
    (a non-finite loss skips without backing off); the unscaled loss and the
    unscaled gradient norm returned, as tunix logs them. `loss_scale` and
    `skipped_steps` are logged with them, through training hooks that call
    the trainer's own ones. Under accumulation (tunix's `MultiSteps`), each
    micro-batch is checked: a non-finite one is dropped and the scale backs off
    at once, as `lossscale.wrap(optax.MultiSteps(tx, k))` does, while the
    optimizer state keeps tunix's layout, so its checkpoints restore.

    Call it once, after building the trainer; for GRPO, on
    `rl_cluster.actor_trainer` after creating the learner.

    Args:
      trainer: a `tunix.sft.peft_trainer.PeftTrainer` or an RL `Trainer`.

    Returns:
      `trainer`, changed in place.

    Raises:
      ImportError: if google-tunix is not installed, or is not a tested version.
      TypeError: if `trainer` is not a tunix trainer, or its optimizer is not
        `lossscale.tunix.wrap(...)`.
    """
    peft_trainer = _tunix_peft_trainer()
    if not isinstance(trainer, peft_trainer.PeftTrainer):
        raise TypeError(
            "`trainer` must be a tunix `PeftTrainer` (or the RL `Trainer`, e.g."
            f" `rl_cluster.actor_trainer`), got {type(trainer).__name__}."
        )
    tx = trainer.optimizer.tx
    if isinstance(tx, optax.MultiSteps) and isinstance(tx.inner_opt, Transformation):
        k = trainer.config.gradient_accumulation_steps
        trainer.optimizer.tx = _accumulating_inside(tx.inner_opt, k)
    elif not isinstance(tx, Transformation | _Accumulating):
        raise TypeError(
            "The trainer's optimizer must be `lossscale.tunix.wrap(tx)`, got"
            f" {type(tx).__name__}: build the trainer with it (`PeftTrainer(model,"
            " lossscale.tunix.wrap(tx), config)`, or `RLTrainingConfig("
            "actor_optimizer=lossscale.tunix.wrap(tx), ...)`)."
        )
    _warn_of_a_float16_mask(trainer.model)
    trainer.create_train_step_fn = lambda: _step_of(trainer)
    tunix_metrics.log_metrics_of(trainer)
    trainer.clear_jit_cache()
    return trainer


def _tunix_peft_trainer() -> Any:
    """`tunix.sft.peft_trainer`, if google-tunix is installed at a tested version."""
    try:
        version = importlib.metadata.version("google-tunix")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(
            "`lossscale.tunix` needs google-tunix: `pip install 'lossscale[tunix]'`."
        ) from None
    if version not in TESTED_TUNIX:
        raise ImportError(
            f"`lossscale.tunix` is tested with google-tunix {', '.join(TESTED_TUNIX)}"
            f" and found {version}: it replaces the trainer's train step, which"
            " another tunix may write otherwise. Install a tested one (`pip install"
            f" google-tunix=={TESTED_TUNIX[-1]}`), or a lossscale that lists yours."
        )
    from tunix.sft import peft_trainer

    return peft_trainer


def _step_of(trainer: Any) -> Any:
    """The loss-scaled train step, in `PeftTrainer._train_step`'s signature."""

    def train_step(model: nnx.Module, optimizer: nnx.Optimizer, inputs: Any) -> Any:
        tunix_metrics.log_metrics_of(trainer)  # at trace time: hooks set since are kept
        inputs = trainer.gen_model_input_fn(inputs)
        state = tunix_metrics.state_of(optimizer)
        has_aux = trainer._has_aux  # no public reader: pinned by TESTED_TUNIX

        def scaled(model, inputs):
            out = trainer.loss_fn(model, **inputs)
            loss, aux = out if has_aux else (out, None)
            return functional.scaled(loss, state), (loss, aux)

        grad_fn = nnx.value_and_grad(
            scaled, argnums=nnx.DiffState(0, optimizer.wrt), has_aux=True
        )
        (_, (loss, aux)), grads = grad_fn(model, inputs)
        # Widened before squaring: a scaled float16 gradient's square overflows.
        wide = jax.tree.map(lambda g: g.astype(jnp.promote_types(g.dtype, "f4")), grads)
        inverse = jnp.ones([], jnp.float32) / state.scale
        grad_norm = optax.global_norm(wide).astype(jnp.float32) * inverse
        optimizer.update(model, grads, value=loss, **{_FROM_THE_STEP: True})
        return loss, aux, grad_norm

    return train_step


class _Accumulating(optax.GradientTransformationExtraArgs):
    """`wrap(MultiSteps(inner, k))` on the state of `MultiSteps(wrap(inner), k)`."""


def _accumulating_inside(ours: Transformation, k: Any) -> _Accumulating:
    """`ours` accumulating `k` micro-batches inside the wrap, in tunix's layout.

    tunix built `MultiSteps(ours, k)`, whose state is `MultiStepsState(...,
    inner_opt_state=WrapState(loss_scale, inner_state))`; its checkpoints hold
    that layout. The update runs `lossscale.wrap(MultiSteps(inner, k))` on the
    same leaves, nested the other way, and nests the result back.
    """
    inside = wrapper.wrap(
        optax.MultiSteps(ours.inner, k), ours.loss_scale, clip_norm=ours.clip_norm
    )

    def update_fn(updates, state, params=None, **extra_args):
        extra_args.pop(_FROM_THE_STEP, None)
        wrapped = state.inner_opt_state
        nested = wrapped._replace(
            inner_state=state._replace(inner_opt_state=wrapped.inner_state)
        )
        updates, new = inside.update(updates, nested, params, **extra_args)
        back = new._replace(inner_state=new.inner_state.inner_opt_state)
        return updates, new.inner_state._replace(inner_opt_state=back)

    return _Accumulating(optax.MultiSteps(ours, k).init, update_fn)


def _warn_of_a_float16_mask(model: Any) -> None:
    """Warns if the model computes in float16 with a mask constant float16 cannot hold.

    tunix's models mask attention with `K_MASK = -2.3819763e38`, -inf in float16:
    a query row with no key left (left padding) then has a NaN softmax, and the
    gradients are NaN at every scale.
    """
    config = getattr(model, "config", None)
    module = sys.modules.get(type(model).__module__)
    mask = getattr(module, "K_MASK", None)
    if module is None or mask is None or getattr(config, "dtype", None) != jnp.float16:
        return
    if abs(float(mask)) <= float(jnp.finfo(jnp.float16).max):
        return
    import warnings

    warnings.warn(
        f"The model computes in float16 and masks attention with {module.__name__}"
        f".K_MASK = {float(mask):.8g}, which is -inf in float16: a row with no key"
        " left (left padding) gets a NaN softmax, and the gradients are NaN at every"
        " loss scale. Set it within float16's range before training:"
        f" `{module.__name__}.K_MASK = float(jnp.finfo(jnp.float16).min)`.",
        stacklevel=3,
    )
