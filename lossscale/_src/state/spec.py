"""Specs: a number, "dynamic" or None, standing for a state where one is created.

Where a state is created (`wrap`, `TrainState.create`, `flax.Optimizer`), a spec
gives one: `from_spec`. Where a state is carried from step to step, a spec is
refused: `validate_state`.
"""

from __future__ import annotations

from typing import Any

from lossscale._src import validation
from lossscale._src.state.kind import LossScale
from lossscale._src.state.kinds import DynamicLossScale
from lossscale._src.state.kinds import NoOpLossScale
from lossscale._src.state.kinds import StaticLossScale

StateOrSpec = LossScale | float | int | str | None
"""Where a state is created: a state, or a spec: a number, "dynamic" or None."""


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
            f" the string {spec!r} (the only string allowed is 'dynamic'; a fixed"
            " scale is a number, e.g. `1024.0`, or `lossscale.StaticLossScale(s)`)."
        )
    if validation.is_number(spec):
        return StaticLossScale(spec)
    if isinstance(spec, type) and issubclass(spec, LossScale):
        raise TypeError(
            f"`{name}` got the class `{spec.__name__}`; pass a state, an instance:"
            f" `{name}={spec.__name__}(...)`."
        )
    raise TypeError(
        f"`{name}` must be a loss-scale state, a number, 'dynamic' or None; got"
        f" {type(spec).__name__}."
    )


def validate_state(value: Any, name: str) -> None:
    """Raises `TypeError` unless `value` is a loss-scale state (not a spec)."""
    if not isinstance(value, LossScale):
        raise TypeError(
            f"`{name}` must be a loss-scale state, got {value!r}: a spec (a number,"
            " 'dynamic' or None) is only read where a state is created. To change"
            " the loss scale of a run, replace it with a state, e.g."
            " `.replace(loss_scale=lossscale.DynamicLossScale())`."
        )
