"""The built-in kinds, defined through the public `LossScale` API."""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale._src import deprecation
from lossscale._src.state import kind_validation
from lossscale._src.state.kind import LossScale
from lossscale._src.state.kind_fields import field

if TYPE_CHECKING:
    from jax.typing import ArrayLike


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

    min_scale = 1.0
    max_scale = 1.0

    if TYPE_CHECKING:  # its dataclass `__init__`, as type checkers should read it

        def __init__(
            self,
            *,
            skipped_steps: ArrayLike = 0,
            consecutive_skips: ArrayLike = 0,
            forward_overflows: ArrayLike = 0,
            stuck: ArrayLike = False,
            overflow_leaf: ArrayLike = -1,
            overflow_scale: ArrayLike = 0.0,
        ) -> None: ...

    @property
    def scale(self) -> jax.Array:  # type: ignore[override]  # read-only, as `_Scale`
        return jnp.ones([], jnp.float32)

    def rule(self, grads_finite: jax.Array) -> NoOpLossScale:
        return self


class StaticLossScale(LossScale, kind="static"):
    """A fixed loss scale.

    The scale is a static setting (not a leaf): it is compiled into the train step
    and never changes. Where a state is created, a number `s` means
    `StaticLossScale(s)` (TF's `FixedLossScale`). Unlike TF's, a step whose
    gradients are not finite is skipped, as with every kind.

    Args:
      value: the loss scale, a number > 0 (positive and finite in float32).

    Raises:
      TypeError: if `value` is not a real number.
      ValueError: if `value` is not positive and finite.

    Examples:
      >>> import lossscale
      >>> loss_scale = lossscale.StaticLossScale(1024)
      >>> print(loss_scale.scale, loss_scale.value)
      1024.0 1024.0
    """

    value: float = field(static=True, kw_only=False)

    if TYPE_CHECKING:  # its dataclass `__init__`, as type checkers should read it

        def __init__(
            self,
            value: float,
            *,
            skipped_steps: ArrayLike = 0,
            consecutive_skips: ArrayLike = 0,
            forward_overflows: ArrayLike = 0,
            stuck: ArrayLike = False,
            overflow_leaf: ArrayLike = -1,
            overflow_scale: ArrayLike = 0.0,
        ) -> None: ...

    def __post_init__(self):
        value = kind_validation.positive_float32("value", self.value, "StaticLossScale")
        object.__setattr__(self, "value", value)

    @property
    def scale(self) -> jax.Array:  # type: ignore[override]  # read-only, as `_Scale`
        return jnp.asarray(self.value, jnp.float32)

    @property
    def min_scale(self) -> float:  # type: ignore[override]  # read-only here
        return self.value

    @property
    def max_scale(self) -> float:  # type: ignore[override]  # read-only here
        return self.value

    def rule(self, grads_finite: jax.Array) -> StaticLossScale:
        return self


class DynamicLossScale(LossScale, kind="dynamic"):
    """A loss scale that grows after finite steps and backs off on overflow.

    The rule (with `hysteresis=1` it is TF/Keras' `DynamicLossScale`):

    * finite step: `counter += 1`; when `counter` reaches `growth_interval`,
      `scale = min(scale * growth_factor, max_scale)` and `counter = 0`.
    * non-finite step (skipped): `counter = 0`; once `hysteresis` such steps have
      happened since the last growth, each backs off, `scale = max(scale *
      backoff_factor, min_scale)` (Megatron-LM's hysteresis).
    * non-finite loss (a forward overflow): skipped and counted; the rule's
      fields stay as they are.

    Float settings are kept as the float32 values the rule uses.

    Args:
      scale: the first scale; by default 2**15 moved into `[min_scale, max_scale]`.
      counter: finite steps in a row since the last growth or overflow; 0.
      overflows_since_growth: overflows since the last growth (<= `hysteresis`).
      growth_interval: finite steps in a row before the scale grows; int >= 1.
      growth_factor: factor applied on growth; > 1.
      backoff_factor: factor applied on backing off; in (0, 1).
      min_scale: the lowest scale; > 0.
      max_scale: the highest scale; finite in float32 and >= `min_scale`.
      hysteresis: overflows since the last growth before backing off; int >= 1.

    Raises:
      TypeError: if a setting has the wrong type.
      ValueError: if a setting is out of range.

    Examples:
      >>> import jax.numpy as jnp, lossscale
      >>> loss_scale = lossscale.DynamicLossScale(scale=8.0, growth_interval=2)
      >>> loss_scale = lossscale.update(loss_scale, jnp.array(False))
      >>> print(loss_scale.scale)  # backed off
      4.0
      >>> loss_scale = lossscale.update(loss_scale, jnp.array(True))
      >>> loss_scale = lossscale.update(loss_scale, jnp.array(True))
      >>> print(loss_scale.scale)  # grew after 2 finite steps
      8.0
    """

    scale: jax.Array = field(dtype=jnp.float32, default=None, kw_only=False)
    counter: jax.Array = field(dtype=jnp.int32, default=0)
    overflows_since_growth: jax.Array = field(dtype=jnp.int32, default=0)
    growth_interval: int = field(static=True, default=2000)
    growth_factor: float = field(static=True, default=2.0)
    backoff_factor: float = field(static=True, default=0.5)
    min_scale: float = field(static=True, default=1.0)
    max_scale: float = field(static=True, default=2.0**24)
    hysteresis: int = field(static=True, default=1)

    if TYPE_CHECKING:
        # Its dataclass `__init__`, as type checkers should read it: an array
        # field takes a Python number too (cast to its dtype).
        def __init__(
            self,
            scale: ArrayLike | None = None,
            *,
            skipped_steps: ArrayLike = 0,
            consecutive_skips: ArrayLike = 0,
            forward_overflows: ArrayLike = 0,
            stuck: ArrayLike = False,
            overflow_leaf: ArrayLike = -1,
            overflow_scale: ArrayLike = 0.0,
            counter: ArrayLike = 0,
            overflows_since_growth: ArrayLike = 0,
            growth_interval: int = 2000,
            growth_factor: float = 2.0,
            backoff_factor: float = 0.5,
            min_scale: float = 1.0,
            max_scale: float = 2.0**24,
            hysteresis: int = 1,
        ) -> None: ...

    def __post_init__(self):
        owner = "DynamicLossScale"
        settings = {
            name: kind_validation.positive_float32(name, getattr(self, name), owner)
            for name in ("growth_factor", "backoff_factor", "min_scale", "max_scale")
        }
        for name in ("growth_interval", "hysteresis"):
            settings[name] = kind_validation.positive_int32(
                name, getattr(self, name), owner
            )
        if settings["growth_factor"] <= 1.0:
            raise ValueError(
                f"`{owner}`: `growth_factor` must be > 1 (in float32), got"
                f" {settings['growth_factor']!r}."
            )
        if settings["backoff_factor"] >= 1.0:
            raise ValueError(
                f"`{owner}`: `backoff_factor` must be in (0, 1) (in float32), got"
                f" {settings['backoff_factor']!r}."
            )
        low, high = settings["min_scale"], settings["max_scale"]
        if low > high:
            raise ValueError(
                f"`{owner}`: `min_scale` ({low!r}) must be <= `max_scale` ({high!r})."
            )
        scale = min(max(2.0**15, low), high) if self.scale is None else self.scale
        if _readable_array(scale):  # a state stacked for `pmap` has many
            values = np.asarray(scale)
            if not (
                jnp.issubdtype(values.dtype, jnp.integer)
                or jnp.issubdtype(values.dtype, jnp.floating)
            ):
                raise TypeError(
                    f"`{owner}`: `scale` must be a real number, got an array of"
                    f" {values.dtype}."
                )
            for value in {float(v) for v in values.ravel()}:
                _validated_scale(value, low, high, owner)
        elif not isinstance(scale, jax.Array | jax.ShapeDtypeStruct):
            scale = _validated_scale(scale, low, high, owner)
        # A traced scale cannot be read here: `update` reports what it becomes.
        for name, value in {**settings, "scale": scale}.items():
            object.__setattr__(self, name, value)

    def rule(self, grads_finite: jax.Array) -> DynamicLossScale:
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


# lossscale 0.2's arguments, with a warning (docs/migration/lossscale_0_2.md).
deprecation.accept_0_2_arguments(
    DynamicLossScale,
    {"initial_scale": "scale"},
    ("scale", "growth_interval", "growth_factor", "backoff_factor")
    + ("min_scale", "max_scale", "hysteresis"),
)
# 0.2 named `value` after the property it sets.
deprecation.accept_0_2_arguments(StaticLossScale, {"scale": "value"}, ("value",))


def _readable_array(value: Any) -> bool:
    """Whether `value` is an array whose values can be read on the host."""
    return isinstance(value, np.ndarray | np.generic) or (
        isinstance(value, jax.Array)
        and not isinstance(value, jax.core.Tracer)
        and value.is_fully_addressable
    )


def _validated_scale(value: Any, low: float, high: float, owner: str) -> float:
    """A first scale as the float32 the rule uses; refused as `positive_float32`."""
    scale = kind_validation.positive_float32("scale", value, owner)
    if not low <= scale <= high:
        raise ValueError(
            f"`{owner}`: `scale` ({scale!r}) must be within [min_scale,"
            f" max_scale] = [{low!r}, {high!r}]."
        )
    return scale
