"""Restoring a checkpoint that lossscale 0.3.0 wrote.

Since 0.3.0 every state also records `overflow_scale`, the scale its latest
skipped step ran at, so a 0.3.0 checkpoint lacks that leaf and Orbax refuses it
with today's state as the target ("tree structures do not match"). The restore
target is laid out as 0.3.0 saved it (`checkpoint_0_3_0_layout`), and the
states rebuilt from what comes back (`from_checkpoint_0_3_0`), the new counter
at its default: any other mismatch is still refused by the restore.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from lossscale._src.state import kind_fields
from lossscale._src.state.kind import ADDED_AFTER_0_3_0
from lossscale._src.state.kind import COUNTERS
from lossscale._src.state.kind import LossScale


def checkpoint_0_3_0_layout(target: Any) -> Any:
    """The restore target for a checkpoint written by lossscale 0.3.0.

    `target` with each loss-scale state as a dict of the fields 0.3.0 saved
    (all but `overflow_scale`), which is what Orbax restores a 0.3.0 state
    into; in the state of a `lossscale.flax.Optimizer` (`nnx.state(optimizer)`,
    where the loss-scale state is a dict of its fields already), the entries
    0.3.0 did not have are left out. Restore into it, then pass what comes back
    to `from_checkpoint_0_3_0` (or, for NNX, to `nnx.update(optimizer, ...)`).

    Args:
      target: the restore target as for a checkpoint of this version, concrete
        or abstract (`jax.ShapeDtypeStruct` leaves): a tree holding loss-scale
        states (a `TrainState`, `(params, opt_state)`, `nnx.state(optimizer)`).

    Returns:
      The same tree, each loss-scale state laid out as 0.3.0 saved it.

    Raises:
      ValueError: if `target` holds no loss-scale state.

    Deprecated in 0.4 as `lossscale.checkpoint_0_3_0_layout`: it is
    `lossscale.checkpoints.layout(target, "0.3.0")` now.
    """
    require_state(target)

    def laid_out(node: Any) -> Any:
        if isinstance(node, LossScale):
            return {n: getattr(node, n) for n in saved_fields(type(node))}
        if is_nnx_entries(node):
            kept = {k: v for k, v in node.items() if k not in ADDED_AFTER_0_3_0}
            return type(node)(kept)
        return node

    return jax.tree.map(laid_out, target, is_leaf=is_state)


def from_checkpoint_0_3_0(restored: Any, target: Any) -> Any:
    """The states of a lossscale 0.3.0 checkpoint, from what the restore returned.

    Each loss-scale state of `target` is rebuilt, of its kind and settings,
    from the fields restored in its place (every field and counter as 0.3.0
    saved it), with `overflow_scale` at its default, 0: the checkpoint does
    not say at which scale a skip it recorded ran. The state of an NNX
    optimizer needs none of this: `nnx.update(optimizer, restored)` leaves the
    optimizer's own `overflow_scale`.

    Args:
      restored: what the restore into `checkpoint_0_3_0_layout(target)`
        returned.
      target: the tree the layout was made from (concrete or abstract).

    Returns:
      `restored` with each loss-scale state rebuilt: the tree a checkpoint of
      this version restores to.

    Raises:
      ValueError: if a loss-scale state's place in `restored` does not hold
        the fields 0.3.0 saved, or the trees do not match.
      TypeError: if it holds a state already (a checkpoint of this version).

    Deprecated in 0.4 as `lossscale.from_checkpoint_0_3_0`: it is
    `lossscale.checkpoints.upgrade(restored, target)` now.
    """
    return jax.tree_util.tree_map_with_path(
        rebuilt, target, restored, is_leaf=lambda x: isinstance(x, LossScale)
    )


def rebuilt(path: Any, node: Any, value: Any) -> Any:
    """The state at `path` of `target` (`node`), from what was restored there."""
    if not isinstance(node, LossScale):
        return value
    where = f"restored{jax.tree_util.keystr(path)}"
    if isinstance(value, LossScale):
        raise TypeError(
            f"`{where}` is a `{type(value).__name__}` already: the checkpoint"
            " was written after 0.3.0 and restores as it is, without the 0.3.0"
            " layout."
        )
    saved = saved_fields(type(node))
    if not isinstance(value, Mapping) or set(value) != set(saved):
        got = sorted(value) if isinstance(value, Mapping) else type(value).__name__
        raise ValueError(
            f"`{where}` must hold the fields 0.3.0 saved of a `{type(node).__name__}`,"
            f" {saved}, got {got}: restore into `lossscale.checkpoints.layout(target,"
            ' "0.3.0")` with the same `target`.'
        )
    return from_saved(node, value)


def saved_fields(kind: type[LossScale]) -> list[str]:
    """The fields a 0.3.0 checkpoint holds of a state of `kind`, in leaf order."""
    return [n for n in kind_fields.leaf_names(kind) if n not in ADDED_AFTER_0_3_0]


def from_saved(node: LossScale, value: Mapping[str, Any]) -> LossScale:
    """A state of `node`'s kind and settings from the fields 0.3.0 (or 0.2) saved of it.

    A field `value` lacks takes its default, with the leading shape of a state
    stacked for `pmap`.
    """
    specs = kind_fields.specs(type(node))
    batch = jnp.shape(value["skipped_steps"])  # a state stacked for `pmap`
    leaves = [
        jnp.asarray(value[n], specs[n].dtype)
        if n in value
        else jnp.full(batch + specs[n].shape, _DEFAULTS[n], specs[n].dtype)
        for n in kind_fields.leaf_names(type(node))
    ]
    return jax.tree.unflatten(jax.tree.structure(node), leaves)


def require_state(target: Any) -> None:
    """Raises `ValueError` unless `target` holds a loss-scale state (NNX's too)."""
    if not any(map(is_state, jax.tree.leaves(target, is_leaf=is_state))):
        raise ValueError(
            f"`target` (a {type(target).__name__}) holds no loss-scale state: pass"
            " the restore target you would use for a checkpoint of this version"
            " (the train state, `(params, opt_state)`, `nnx.state(optimizer)`)."
        )


# The counters' defaults, which a 0.3.0 checkpoint's missing ones take.
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(LossScale)}


def is_state(node: Any) -> bool:
    """A loss-scale state, or one as `nnx.state` holds it."""
    return isinstance(node, LossScale) or is_nnx_entries(node)


def is_nnx_entries(node: Any) -> bool:
    """A loss-scale state as `nnx.state` holds it: a mapping of its fields."""
    return isinstance(node, Mapping) and set(COUNTERS) <= set(node)
