"""Flax serialization of loss-scale states: each kind's fields by name.

`flax.serialization` (`to_bytes`, `to_state_dict`, Flax's checkpoints) reads every
kind's fields by name; the settings come from the target. Imported by
`lossscale.flax` only, since it needs Flax.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import serialization

from lossscale._src.state import kind
from lossscale._src.state import kind_fields
from lossscale._src.state.kind import ADDED_AFTER_0_3_0
from lossscale._src.state.kind import LossScale


def _to_state_dict(state: LossScale) -> dict[str, Any]:
    return {
        name: serialization.to_state_dict(getattr(state, name))
        for name in kind_fields.leaf_names(type(state))
    }


def _from_state_dict(target: LossScale, state: dict[str, Any], name: str = ".") -> Any:
    cls = type(target)
    names = kind_fields.leaf_names(cls)
    if isinstance(state, dict) and set(state) | set(ADDED_AFTER_0_3_0) == set(names):
        # A state dict that lossscale 0.3.0 wrote: the counters added since
        # take their defaults (those of a fresh state, in the target's shape).
        fresh = {f.name: f.default for f in dataclasses.fields(LossScale)}
        specs = kind_fields.specs(cls)
        shapes = {n: np.shape(getattr(target, n)) for n in ADDED_AFTER_0_3_0}
        state = {
            n: state[n] if n in state else np.full(shapes[n], fresh[n], specs[n].dtype)
            for n in names
        }
    if not isinstance(state, dict) or set(state) != set(names):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"The state dict at {name!r} must hold the fields {list(names)} of"
            f" a `{cls.__name__}`, got {got}. (A lossscale 0.2 state held"
            " `int32_fields`/`float32_fields`: see `lossscale.checkpoints.upgrade`.)"
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
