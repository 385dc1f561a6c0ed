"""The built-in loss-scale kinds, defined through the public `LossScale` API.

Also `from_spec`: where a state is created (`wrap`, `TrainState.create`,
`flax.Optimizer`), a spec (a number, "dynamic" or None) may stand for one.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from lossscale._src import checks
from lossscale._src.base import LossScale
from lossscale._src.fields import field
from lossscale._src.fields import setting


class NoOpLossScale(LossScale, kind="none"):
    """A loss scale of 1 that never changes.

    Use it to keep the train step and its skip of non-finite steps while turning
    loss scaling off, e.g. when computing in bfloat16 or float32. Where a state is
    created (`lossscale.wrap`, `TrainState.create`), `None` means
    `NoOpLossScale()`.

    Examples:
      >>> import lossscale
      >>> loss_scale = lossscale.NoOpLossScale()
      >>> print(loss_scale.scale)
      1.0
    """

    __slots__ = ()
    lowest_scale = 1.0
    highest_scale = 1.0

    def __init__(self):
        super().__init__()

    @property
    def scale(self) -> jax.Array:
        return jnp.ones([], jnp.float32)

    def adjust(self, grads_finite: jax.Array) -> NoOpLossScale:
        return self


class StaticLossScale(LossScale, kind="static"):
    """A fixed loss scale.

    The scale is a static setting (not a leaf): it is compiled into the train step
    and never changes. Where a state is created, a number `s` means
    `StaticLossScale(s)` (TF's `FixedLossScale`).

    Unlike TF's `FixedLossScale`, which applies non-finite gradients, lossscale
    skips a step whose gradients are not finite with every kind of loss scale:
    with a fixed scale there is nothing to recover from an update with infinities
    in it.

    Args:
      scale: the loss scale, a finite number > 0 (positive and finite in float32).

    Raises:
      TypeError: if `scale` is not a real number.
      ValueError: if `scale` is not positive and finite.

    Examples:
      >>> import lossscale
      >>> loss_scale = lossscale.StaticLossScale(1024)
      >>> print(loss_scale.scale)
      1024.0
    """

    __slots__ = ()
    _scale = setting()

    def __init__(self, scale: float):
        super().__init__(
            _scale=checks.positive_float32("scale", scale, "StaticLossScale")
        )

    @property
    def scale(self) -> jax.Array:
        return jnp.asarray(self._scale, jnp.float32)

    @property
    def lowest_scale(self) -> float:
        return self._scale

    @property
    def highest_scale(self) -> float:
        return self._scale

    def adjust(self, grads_finite: jax.Array) -> StaticLossScale:
        return self


class DynamicLossScale(LossScale, kind="dynamic"):
    """A loss scale that grows after finite steps and backs off on overflow.

    The rule (with `hysteresis=1` it is TF/Keras' `DynamicLossScale`):

    * finite step: `counter += 1`; when `counter` reaches `growth_interval`,
      `scale = min(scale * growth_factor, max_scale)` and `counter = 0`: the scale
      grows on the `growth_interval`-th consecutive finite step.
    * non-finite step (the update is skipped): `counter = 0`, and once `hysteresis`
      non-finite steps have happened since the last growth, every further one backs
      off, `scale = max(scale * backoff_factor, min_scale)` (Megatron-LM's
      hysteresis).
    * non-finite loss (a forward overflow, reported with `lossscale.update`'s
      `loss_finite`): the update is skipped and counted, but the scale, `counter`
      and `overflows_since_growth` stay as they are: the scale did not cause it.

    The scale stays within `[min_scale, max_scale]`: it never becomes 0, inf or NaN.
    The rule computes in float32, and float settings are kept (and shown) as the
    float32 values it uses: `backoff_factor=0.7` reads back as 0.699999988.

    Args:
      initial_scale: the first scale, within `[min_scale, max_scale]`; by default
        2**15 (TF/Keras' default), moved into `[min_scale, max_scale]`.
      growth_interval: number of consecutive finite steps after which the scale
        grows (TF's `dynamic_growth_steps`, `increment_period`); an int >= 1.
      growth_factor: factor applied on growth; > 1.
      backoff_factor: factor applied on backing off; in (0, 1).
      min_scale: the lowest scale; > 0.
      max_scale: the highest scale; finite in float32 and >= `min_scale`.
      hysteresis: number of non-finite steps since the last growth before the scale
        backs off; an int >= 1.

    Attributes:
      scale: float32 scalar array, the current loss scale.
      counter: int32 scalar array, consecutive finite steps since the scale last
        grew or since the last non-finite step.
      overflows_since_growth: int32 scalar array, non-finite steps since the last
        growth, capped at `hysteresis`.
      skipped_steps, consecutive_skips, forward_overflows, stuck: the counters
        every state has (see `lossscale.LossScale`).

    Raises:
      TypeError: if a setting has the wrong type.
      ValueError: if a setting is out of range.

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale
      >>> loss_scale = lossscale.DynamicLossScale(initial_scale=8.0,
      ...                                         growth_interval=2)
      >>> loss_scale = lossscale.update(loss_scale, jnp.array(False))
      >>> print(loss_scale.scale)  # backed off
      4.0
      >>> loss_scale = lossscale.update(loss_scale, jnp.array(True))
      >>> loss_scale = lossscale.update(loss_scale, jnp.array(True))
      >>> print(loss_scale.scale)  # grew after 2 finite steps
      8.0
    """

    __slots__ = ()
    scale = field(jnp.float32)
    counter = field(jnp.int32)
    overflows_since_growth = field(jnp.int32)
    growth_interval = setting()
    growth_factor = setting()
    backoff_factor = setting()
    min_scale = setting()
    max_scale = setting()
    hysteresis = setting()

    def __init__(
        self,
        initial_scale: float | None = None,
        growth_interval: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        hysteresis: int = 1,
    ):
        owner = "DynamicLossScale"
        min_scale = checks.positive_float32("min_scale", min_scale, owner)
        max_scale = checks.positive_float32("max_scale", max_scale, owner)
        growth_factor = checks.positive_float32("growth_factor", growth_factor, owner)
        backoff_factor = checks.positive_float32(
            "backoff_factor", backoff_factor, owner
        )
        if growth_factor <= 1.0:
            raise ValueError(
                f"`{owner}`: `growth_factor` must be > 1 (in float32), got"
                f" {growth_factor!r}."
            )
        if backoff_factor >= 1.0:
            raise ValueError(
                f"`{owner}`: `backoff_factor` must be in (0, 1) (in float32), got"
                f" {backoff_factor!r}."
            )
        if min_scale > max_scale:
            raise ValueError(
                f"`{owner}`: `min_scale` ({min_scale!r}) must be <= `max_scale`"
                f" ({max_scale!r})."
            )
        if initial_scale is None:
            initial_scale = min(max(2.0**15, min_scale), max_scale)
        initial_scale = checks.positive_float32("initial_scale", initial_scale, owner)
        if not min_scale <= initial_scale <= max_scale:
            raise ValueError(
                f"`{owner}`: `initial_scale` ({initial_scale!r}) must be within"
                f" [min_scale, max_scale] = [{min_scale!r}, {max_scale!r}]."
            )
        super().__init__(
            scale=initial_scale,
            counter=0,
            overflows_since_growth=0,
            growth_interval=checks.positive_int32(
                "growth_interval", growth_interval, owner
            ),
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            min_scale=min_scale,
            max_scale=max_scale,
            hysteresis=checks.positive_int32("hysteresis", hysteresis, owner),
        )

    @property
    def lowest_scale(self) -> float:
        return self.min_scale

    @property
    def highest_scale(self) -> float:
        return self.max_scale

    def adjust(self, grads_finite: jax.Array) -> DynamicLossScale:
        counter = self.counter + 1
        grow = grads_finite & (counter >= self.growth_interval)
        overflows = jnp.where(
            grads_finite,
            jnp.where(grow, 0, self.overflows_since_growth),
            jnp.minimum(self.overflows_since_growth + 1, self.hysteresis),
        )
        back_off = ~grads_finite & (overflows >= self.hysteresis)
        # Settings are Python floats: as weak-typed operands they stay float32.
        grown = jnp.minimum(self.scale * self.growth_factor, self.max_scale)
        backed_off = jnp.maximum(self.scale * self.backoff_factor, self.min_scale)
        return self.replace(
            scale=jnp.where(grow, grown, jnp.where(back_off, backed_off, self.scale)),
            counter=jnp.where(grads_finite & ~grow, counter, 0),
            overflows_since_growth=overflows,
        )


LossScaleLike = LossScale | float | int | str | None
"""Where a state is created: a state, a number (static), "dynamic" or None (no-op)."""


def from_spec(spec: Any, name: str = "loss_scale") -> LossScale:
    """A new state from a spec, as TF does; a given state is returned as is.

    A number gives `StaticLossScale(number)`, `"dynamic"` a default
    `DynamicLossScale()` and `None` a `NoOpLossScale()`.
    """
    if isinstance(spec, LossScale):
        return spec
    if spec is None:
        return NoOpLossScale()
    if isinstance(spec, str):
        if spec == "dynamic":
            return DynamicLossScale()
        raise ValueError(
            f"`{name}` must be a loss-scale state, a number, 'dynamic' or None; got"
            f" the string {spec!r} (the only string allowed is 'dynamic')."
        )
    if checks.is_number(spec):
        return StaticLossScale(spec)
    raise TypeError(
        f"`{name}` must be a loss-scale state, a number, 'dynamic' or None; got"
        f" {type(spec).__name__}."
    )


def fresh_copy(state: LossScale) -> LossScale:
    """`state` with new buffers: safe to donate without touching the original."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), state)
