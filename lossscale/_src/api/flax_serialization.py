"""Flax serialization of loss-scale states: each kind's fields by name.

`flax.serialization` (`to_bytes`, `to_state_dict`, Flax's checkpoints) reads every
kind's fields by name; the settings come from the target. Imported by
`lossscale.flax` only, since it needs Flax.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import serialization

from lossscale._src.state import kind
from lossscale._src.state import kind_fields
from lossscale._src.state.kind import LossScale


def _to_state_dict(state: LossScale) -> dict[str, Any]:
    return {
        name: serialization.to_state_dict(getattr(state, name))
        for name in kind_fields.leaf_names(type(state))
    }


def _from_state_dict(target: LossScale, state: dict[str, Any], name: str = ".") -> Any:
    cls = type(target)
    names = kind_fields.leaf_names(cls)
    if not isinstance(state, dict) or set(state) != set(names):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"The state dict at {name!r} must hold the fields {list(names)} of"
            f" a `{cls.__name__}`, got {got}. (A lossscale 0.2 state held"
            " `int32_fields`/`float32_fields`: see `lossscale.from_checkpoint_0_2`.)"
        )
    leaves = [
        serialization.from_state_dict(getattr(target, n), state[n], name=n)
        for n in names
    ]
    return jax.tree.structure(target).unflatten(leaves)


kind.for_every_kind(
    lambda cls: serialization.register_serialization_state(
        cls, _to_state_dict, _from_state_dict, override=True
    )
)
