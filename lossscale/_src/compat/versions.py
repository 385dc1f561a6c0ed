"""A checkpoint of any known lossscale version: its restore target, and its states.

A checkpoint written by lossscale 0.4 or later restores into today's states as it
is. An older one holds other leaves in a state's place: 0.2 packed a state's fields
into one array per dtype (`checkpoints`), 0.3.0 saved every field but
`overflow_scale` (`checkpoint_0_3_0`). `layout` lays the restore target out as the
version given saved it; `upgrade` rebuilds each state from what the restore
returned, reading the version from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from lossscale._src.compat import checkpoint_0_3_0
from lossscale._src.compat import checkpoints
from lossscale._src.state.kind import LossScale

# The versions whose checkpoints lay a state out otherwise than today's, and the
# spellings of each that `layout` takes.
VERSIONS = ("0.2", "0.3.0")
_SPELLINGS = {"0.2": "0.2", "0.2.0": "0.2", "0.3": "0.3.0", "0.3.0": "0.3.0"}


def layout(target: Any, version: str) -> Any:
    """The restore target for a checkpoint that lossscale `version` wrote.

    `target` with each loss-scale state laid out as `version` saved it: for
    0.3.0, a dict of the fields it saved (all but `overflow_scale`); for 0.2,
    `{"int32_fields": ..., "float32_fields": ...}`, the arrays it packed the
    fields into, as `jax.ShapeDtypeStruct` leaves (with the state's leading shape, for
    a state stacked for `pmap`). In the state of a `lossscale.flax.Optimizer`
    (`nnx.state(optimizer)`) the entries 0.3.0 did not have are left out.
    Restore into it, then pass what comes back to `upgrade` (or, for NNX, to
    `nnx.update(optimizer, ...)`). A checkpoint written by 0.4 or later needs
    none of this: restore into `target` itself.

    Args:
      target: the restore target as for a checkpoint of this version, concrete
        or abstract (`jax.ShapeDtypeStruct` leaves): a tree holding loss-scale
        states (a `TrainState`, `(params, opt_state)`, `nnx.state(optimizer)`)
        of the kinds and settings the checkpoint was written with
        (`lossscale.LossScale.from_config(saved_config)` builds one).
      version: the lossscale version that wrote the checkpoint: "0.2" (or
        "0.2.0") or "0.3.0" (or "0.3").

    Returns:
      The same tree, each loss-scale state laid out as `version` saved it.

    Raises:
      ValueError: if `version` is not one of those, or `target` holds no
        loss-scale state (or, for 0.2, holds a Flax NNX optimizer's).

    Examples:
      >>> import jax.numpy as jnp, lossscale
      >>> target = {"w": jnp.zeros(2), "loss_scale": lossscale.DynamicLossScale()}
      >>> print(lossscale.checkpoints.layout(target, "0.2")["loss_scale"])
      {'int32_fields': ShapeDtypeStruct(shape=(6,), dtype=int32),
       'float32_fields': ShapeDtypeStruct(shape=(1,), dtype=float32)}
    """
    known = _SPELLINGS.get(version) if isinstance(version, str) else None
    if known is None:
        raise ValueError(
            f"`version` must be one of {VERSIONS}, the versions whose checkpoints"
            f" lay a loss-scale state out otherwise, got {version!r}. A checkpoint"
            " written by lossscale 0.4 or later restores into today's target as"
            " it is."
        )
    if known == "0.3.0":
        return checkpoint_0_3_0.checkpoint_0_3_0_layout(target)
    checkpoint_0_3_0.require_state(target)

    def packed(node: Any) -> Any:
        if checkpoint_0_3_0.is_nnx_entries(node):
            raise ValueError(
                "`target` holds a Flax NNX optimizer's state (a loss-scale state as"
                " a dict of its fields): lossscale 0.2 had no"
                " `lossscale.flax.Optimizer`, so no 0.2 checkpoint holds one."
            )
        if not isinstance(node, LossScale):
            return node
        batch = tuple(jax.numpy.shape(node.skipped_steps))  # stacked for `pmap`
        return checkpoints.checkpoint_0_2_layout(node.get_config(), batch_shape=batch)

    return jax.tree.map(packed, target, is_leaf=checkpoint_0_3_0.is_state)


def upgrade(restored: Any, target: Any) -> Any:
    """The states of a checkpoint of any known version, from what the restore gave.

    Each loss-scale state of `target` is rebuilt, of its kind and settings, from
    what the restore put in its place, whichever version wrote it: 0.2's packed
    arrays, 0.3.0's fields (with `overflow_scale` at its default, 0: the
    checkpoint does not say at which scale a skip it recorded ran), or a state
    already (0.4 and later: kept as it is). Fields a version did not save take
    their defaults; every field it saved keeps its value. The state of a Flax NNX
    optimizer (`nnx.state(optimizer)`) comes back as restored: pass it to
    `nnx.update(optimizer, ...)`, which keeps the optimizer's own
    `overflow_scale`.

    Args:
      restored: what the restore into `layout(target, version)` returned (or
        into `target`, for a checkpoint of 0.4 or later).
      target: the tree the layout was made from (concrete or abstract).

    Returns:
      `restored` with each loss-scale state rebuilt: the tree a checkpoint of
      this version restores to.

    Raises:
      ValueError: if `target` holds no loss-scale state, a state's place in
        `restored` holds none of the known layouts of its kind, or the trees do
        not match.
      TypeError: if a state's place holds the restore target itself
        (`jax.ShapeDtypeStruct` leaves), not what was restored.

    Examples:
      >>> import numpy as np, lossscale
      >>> target = {"loss_scale": lossscale.DynamicLossScale()}
      >>> restored = {"loss_scale": {"int32_fields": np.array([2, 0, 0, 0, 1, 2]),
      ...                            "float32_fields": np.array([512.0])}}
      >>> state = lossscale.checkpoints.upgrade(restored, target)["loss_scale"]
      >>> print(state.scale, state.counter, state.skipped_steps)
      512.0 1 2
    """
    states = checkpoint_0_3_0.is_state
    if not any(map(states, jax.tree.leaves(target, is_leaf=states))):
        swapped = any(
            isinstance(x, LossScale) for x in jax.tree.leaves(restored, is_leaf=states)
        )
        raise ValueError(
            f"`target` (a {type(target).__name__}) holds no loss-scale state"
            + (
                ", and `restored` does: swap them (`upgrade(restored, target)`)."
                if swapped
                else ": pass the tree the layout was made from (the train state,"
                " `(params, opt_state)`), not the layout."
            )
        )

    def rebuilt(path: Any, node: Any, value: Any) -> Any:
        if not isinstance(node, LossScale) or isinstance(value, LossScale):
            return value  # not a state, an NNX optimizer's entries, or today's
        where = f"restored{jax.tree_util.keystr(path)}"
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(value)):
            raise TypeError(
                f"`{where}` holds `ShapeDtypeStruct`s:"
                " it is the restore target from `layout`, not what was restored."
                " Restore the checkpoint into that target and pass the tree the"
                " restore returns."
            )
        if checkpoints.is_packed(value):
            return checkpoints.from_checkpoint_0_2(
                value, node.get_config(), where=where
            )
        saved = checkpoint_0_3_0.saved_fields(type(node))
        if not isinstance(value, Mapping) or set(value) != set(saved):
            got = sorted(value) if isinstance(value, Mapping) else type(value).__name__
            raise ValueError(
                f"`{where}` holds none of the layouts of a `{type(node).__name__}`:"
                f" a state (lossscale 0.4 or later), the fields 0.3.0 saved {saved},"
                " or 0.2's arrays ['float32_fields', 'int32_fields']; got"
                f" {got}. Restore into `lossscale.checkpoints.layout(target, version)`"
                " with the same `target`."
            )
        return checkpoint_0_3_0.from_saved(node, value)

    return jax.tree_util.tree_map_with_path(rebuilt, target, restored, is_leaf=states)
