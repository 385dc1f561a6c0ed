"""Flax integrations: a linen `TrainState` and an `nnx.Optimizer` with loss scaling.

Flax is an optional dependency: this module is imported only by `lossscale.flax`.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from typing import Any
from typing import Self

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax import struct
from flax.training import train_state

from lossscale._src import validation
from lossscale._src.api import apply
from lossscale._src.api import flax_serialization  # noqa: F401 - registers the kinds
from lossscale._src.api import lookup
from lossscale._src.api import wrapper
from lossscale._src.state import spec
from lossscale._src.state.kind import LossScale
from lossscale._src.state.update import was_applied
from lossscale._src.step import fp8
from lossscale._src.step import step


class TrainState(train_state.TrainState):
    """Flax's `TrainState` with loss scaling and exact skips of non-finite steps.

    Create it with `TrainState.create(apply_fn=..., params=..., tx=...,
    loss_scale=...)`, with any unwrapped optax `tx`; differentiate the scaled loss
    (`lossscale.value_and_grad(loss_fn)(state, ...)`) and pass the gradients to
    `apply_gradients`. It checks whether the unscaled gradients are finite; if so it
    unscales them and runs `tx` inside one `jax.lax.cond`, else leaves `params` and
    `opt_state` untouched, bit for bit; `step` advances only on applied steps (so it
    equals the optimizer's count); `loss_scale` moves either way. With Flax's fp8
    layers pass the whole variables dict as `params` (`docs/design.md`, "fp8
    metadata"). The state holds arrays only: a jitted step called on its own
    output compiles once.

    Attributes:
      loss_scale: the loss-scale state (`lossscale.DynamicLossScale`, ...).
      axis_name: static; as in `lossscale.wrap`.
      clip_norm: static; as in `lossscale.wrap`.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, lossscale, lossscale.flax
      >>> state = lossscale.flax.TrainState.create(
      ...     apply_fn=lambda params, x: params["w"] * x,
      ...     params={"w": jnp.array(1.0)}, tx=optax.sgd(0.25), loss_scale="dynamic")
      >>> @jax.jit
      ... def train_step(state, x):
      ...     loss_fn = lambda params: state.apply_fn(params, x) ** 2
      ...     loss, grads = lossscale.value_and_grad(loss_fn)(state, state.params)
      ...     return state.apply_gradients(grads=grads), loss
      >>> state, loss = train_step(state, jnp.array(1.0))
      >>> print(loss, state.params["w"], state.step)
      1.0 0.5 1
      >>> state, loss = train_step(state, jnp.array(jnp.inf))  # skipped
      >>> print(state.params["w"], state.step, state.loss_scale.scale)
      0.5 1 16384.0
    """

    loss_scale: LossScale = struct.field(pytree_node=True)
    # Keyword-only: a subclass may add fields without defaults, as Flax's
    # examples do (`batch_stats: Any`).
    axis_name: Any = struct.field(pytree_node=False, default=None, kw_only=True)
    clip_norm: float | None = struct.field(
        pytree_node=False, default=None, kw_only=True
    )

    @classmethod
    def create(
        cls,
        *,
        apply_fn: Callable[..., Any],
        params: Any,
        tx: optax.GradientTransformation,
        loss_scale: spec.StateOrSpec = "dynamic",
        axis_name: validation.AxisName | None = None,
        clip_norm: float | None = None,
        **kwargs: Any,
    ) -> Self:
        """Creates a train state with `step` 0 and fresh optimizer state.

        Args:
          apply_fn: usually the model's `apply`.
          params: the parameters to train.
          tx: the optax optimizer, not wrapped with `lossscale.wrap` (the train
            state does the loss scaling itself).
          loss_scale: a loss-scale state, a number (a static scale), `"dynamic"`
            (a default `DynamicLossScale()`) or `None` (no scaling, but non-finite
            steps are still skipped).
          axis_name: the `shard_map`/`pmap` axis name (or tuple of names) to agree
            on skips over; None under plain `jax.jit` (see `lossscale.wrap`).
          clip_norm: clip the unscaled gradients to this global norm before
            `tx`, in the same pass as the finiteness check (see `lossscale.wrap`).
          **kwargs: further fields of a subclass.

        Returns:
          The new `TrainState`.

        Raises:
          TypeError: if `tx` is not an optax transformation; `params` holds a
            loss-scale state; `loss_scale`, `axis_name` or `clip_norm` is not
            one of the above; or a keyword
            is not a field of the class, or one `create` sets itself.
          ValueError: if `tx` holds a loss-scale state already, `clip_norm` is
            not positive, or Flax fp8 variables meet an `optax.MultiSteps`.
        """
        validation.validate_transformation(tx, "tx")
        options = step.step_options(axis_name, clip_norm)
        template = spec.from_spec(loss_scale)
        _validate_field_names(cls, kwargs, "create", ("step", "opt_state"))
        lookup.refuse_in_params(params, "`TrainState.create`")
        # Flax's fp8 metadata are no optimizer's business (design.md).
        opt_state = tx.init(fp8.trainable(params))
        lookup.refuse_wrapped(opt_state, "tx", "the train state")
        fp8.refuse_accumulation(params, opt_state, "`TrainState`")
        return cls(
            step=jnp.zeros([], jnp.int32),
            apply_fn=apply_fn,
            params=params,
            tx=tx,
            opt_state=opt_state,
            loss_scale=wrapper.fresh_copy(template),
            axis_name=options.axis_name,
            clip_norm=options.clip_norm,
            **kwargs,
        )

    @validation.by_keyword(1, "`state.apply_gradients(grads=grads)`")
    def apply_gradients(
        self, *, grads: Any, value: jax.typing.ArrayLike | None = None, **kwargs: Any
    ) -> Self:
        """Applies the gradients of the scaled loss, or skips them if not finite.

        Args:
          grads: gradients of the *scaled* loss, same tree as `params`.
          value: the unscaled loss, optional: if not finite, the step is skipped
            as a forward overflow and the scale does not back off.
          **kwargs: further fields to replace, as in Flax's `TrainState` (e.g.
            `batch_stats`); a skipped step keeps their old values too.

        Returns:
          The next state: on an applied step `step + 1`, new `params`,
          `opt_state` and `kwargs` fields; on a skipped one the state as it was.
          `loss_scale` is updated either way.

        Raises:
          TypeError: if `loss_scale` is not a state, a gradient leaf is not
            floating point, `tx.update` changes the dtype of a state leaf, or
            a keyword is not a field (or is one the step computes).
          ValueError: if `grads` and `params` differ in tree structure, a
            `kwargs` field's new value has another tree than its old one, or
            Flax fp8 variables meet an `optax.MultiSteps` state.
        """
        spec.validate_state(self.loss_scale, "loss_scale")
        computed = ("step", "params", "opt_state", "loss_scale")
        _validate_field_names(type(self), kwargs, "apply_gradients", computed)
        fp8.refuse_accumulation(self.params, self.opt_state, "`TrainState`")
        options = step.StepOptions(self.axis_name, self.clip_norm)
        result = step.guarded_step(
            step.StepInput(self.loss_scale, grads, self.params, value, options),
            apply.optimizer_update(self.tx, {} if value is None else {"value": value}),
            self.opt_state,
            apply_updates=True,
        )
        applied, count = result.applied, jnp.asarray(self.step)
        return self.replace(
            step=count + applied.astype(count.dtype),
            params=result.output,
            opt_state=result.carry,
            loss_scale=result.loss_scale,
            **{name: self._kept(name, new, applied) for name, new in kwargs.items()},
        )

    def _kept(self, name: str, new: Any, applied: jax.Array) -> Any:
        """`new` on an applied step, the field's old value on a skipped one."""
        # `apply_gradients` checked that `name` is a field.
        declared = {f.name: f for f in dataclasses.fields(self)}[name]
        if not declared.metadata.get("pytree_node", True):
            return new  # static, as `apply_fn`: the same on every step
        old = getattr(self, name)
        if jax.tree.structure(new) != jax.tree.structure(old):
            raise ValueError(
                f"`apply_gradients({name}=...)`: the new value has another tree than"
                f" the field's ({jax.tree.structure(new)} vs"
                f" {jax.tree.structure(old)}), so a skipped step could not keep the"
                f" old one. Give `{name}` its final tree when creating the state."
            )
        return jax.tree.map(lambda n, o: jnp.where(applied, n, o), new, old)


def _validate_field_names(
    cls: type, kwargs: dict, method: str, computed: tuple
) -> None:
    """Raises `TypeError` naming a keyword that is no field `method` takes."""
    names = [f.name for f in dataclasses.fields(cls)]
    for name in kwargs:
        if name in computed:
            raise TypeError(
                f"`{cls.__name__}.{method}` computes `{name}` itself; pass only the"
                " other fields (e.g. `batch_stats=...`)."
            )
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" (did you mean `{close[0]}`?)" if close else ""
            raise TypeError(
                f"`{cls.__name__}.{method}` got an unexpected keyword argument"
                f" `{name}`{hint}: it takes the fields {names}. Declare a new"
                " field in a subclass, e.g. `batch_stats: Any = None`."
            )


class Optimizer(nnx.Optimizer):
    """`flax.nnx.Optimizer` with loss scaling and exact skips of non-finite steps.

    It wraps `tx` with `lossscale.wrap(tx, loss_scale)`, so a non-finite step leaves
    the parameters and the inner optimizer state unchanged bit for bit, and its
    `step` advances only on applied steps. Scale the loss with
    `lossscale.scale_loss(loss, optimizer)` in the function given to `nnx.grad`.

    Args:
      model: the NNX module.
      tx: the optax optimizer, not wrapped with `lossscale.wrap`.
      wrt: the filter of variables to optimise, as for `nnx.Optimizer`.
      loss_scale: a loss-scale state, a number, `"dynamic"` or `None`.
      axis_name: as in `lossscale.wrap`.
      clip_norm: as in `lossscale.wrap`.
      **kwargs: passed on to `nnx.Optimizer` (e.g. `graph=`).

    Raises:
      TypeError: if `tx`, `loss_scale`, `axis_name` or `clip_norm` is invalid.
      ValueError: if `tx` is wrapped already, or `clip_norm` is not positive.

    Examples:
      >>> import jax.numpy as jnp, optax, lossscale, lossscale.flax
      >>> from flax import nnx
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> optimizer = lossscale.flax.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      >>> @nnx.jit
      ... def train_step(model, optimizer, x):
      ...     def loss_fn(model):
      ...         return lossscale.scale_loss(jnp.mean(model(x) ** 2), optimizer)
      ...     optimizer.update(model, nnx.grad(loss_fn)(model))
      >>> train_step(model, optimizer, jnp.ones((4, 2)))
      >>> train_step(model, optimizer, jnp.full((4, 2), jnp.inf))  # skipped
      >>> print(optimizer.step[...], optimizer.loss_scale.skipped_steps)
      1 1
    """

    def __init__(
        self,
        model: nnx.Module,
        tx: optax.GradientTransformation,
        *,
        wrt: Any,
        loss_scale: spec.StateOrSpec = "dynamic",
        axis_name: validation.AxisName | None = None,
        clip_norm: float | None = None,
        **kwargs: Any,
    ):
        tx = wrapper.wrap(tx, loss_scale, axis_name=axis_name, clip_norm=clip_norm)
        super().__init__(model, tx, wrt=wrt, **kwargs)

    @property
    def loss_scale(self) -> LossScale:
        """The loss-scale state, with plain arrays as leaves."""
        pure = getattr(nnx, "as_pure", None) or nnx.pure  # Flax 0.12, 0.11
        return lookup.find(pure(self.opt_state), "opt_state")

    def update(self, model: nnx.Module, grads: Any, /, **kwargs: Any) -> optax.Updates:
        """Updates the model from gradients of the scaled loss; see `nnx.Optimizer`.

        Args:
          model: the NNX module.
          grads: gradients of the *scaled* loss, from `nnx.grad`.
          **kwargs: extra arguments for the transformation's `update`.

        Returns:
          The updates applied: zeros (negative zeros, which leave every parameter
          bit for bit unchanged) on a skipped step.
        """
        updates = super().update(model, grads, **kwargs)
        # `nnx.Optimizer.update` always counts a step; take a skipped one back.
        # (It runs the step through `tx.update`, whose result has no `applied`:
        # the loss-scale state records it.)
        skipped = ~was_applied(self.loss_scale)
        self.step[...] -= skipped.astype(self.step.dtype)
        return updates
