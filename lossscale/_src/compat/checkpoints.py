"""Checkpoints: checking a restore's loss scale, and reading lossscale 0.2's.

A checkpoint of a train state saves the loss-scale state's arrays (the dynamic
scale and the counters) but not its static settings, which live in the code: a
static scale and a no-op scale even have the same arrays. Saving
`state.get_config()` next to the arrays lets a restore check that the code's loss
scale is the one the checkpoint was written with (`check_config`). lossscale 0.2
packed a state's fields into one array per dtype; `checkpoint_0_2_layout` and
`from_checkpoint_0_2` read those (through `versions.layout` and `versions.upgrade`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale._src import deprecation
from lossscale._src.api import lookup
from lossscale._src.compat import checkpoint_0_3_0
from lossscale._src.state import kind_fields
from lossscale._src.state import kind_validation
from lossscale._src.state.kind import ADDED_AFTER_0_3_0
from lossscale._src.state.kind import COUNTERS
from lossscale._src.state.kind import LossScale
from lossscale._src.state.registry import KINDS
from lossscale._src.state.registry import known_kinds


def check_config(saved: dict[str, Any], loss_scale: Any) -> None:
    """Raises `ValueError` if `loss_scale` differs from the saved config.

    Call it before restoring a checkpoint, with the dict `get_config()` returned
    when it was written. A checkpoint's arrays alone cannot tell a static scale
    from another static scale or from no scaling, and they never hold the dynamic
    settings, so without this check such a restore would silently continue with
    other settings.

    Args:
      saved: the dict `get_config()` returned when the checkpoint was written.
      loss_scale: the loss scale the code restores into: a state, or a tree
        holding one (an optimizer state, a train state).

    A static scale's config written by 0.2 (`{"kind": "static", "scale": s}`)
    is read as `{"kind": "static", "value": s}`, with a `DeprecationWarning`.

    Raises:
      ValueError: if the kinds or settings differ (the message lists the
        differences and the migration path), `saved` is not a config, or
        `loss_scale` holds no state (or several).
      TypeError: if `loss_scale` is a spec (a number, "dynamic" or None), or
        the arguments are swapped.

    Examples:
      >>> import lossscale
      >>> saved = lossscale.DynamicLossScale().get_config()
      >>> lossscale.checkpoints.check_config(saved, lossscale.DynamicLossScale())
      >>> try:
      ...     lossscale.checkpoints.check_config(saved, lossscale.StaticLossScale(1024))
      ... except ValueError as error:
      ...     print(str(error).splitlines()[0])
      The checkpoint was written with another loss scale than the code's:
    """
    if isinstance(saved, LossScale) and isinstance(loss_scale, Mapping):
        raise TypeError(
            "`check_config(saved, loss_scale)` got a state as `saved` and a dict as"
            " `loss_scale`: swap them (the saved config comes first)."
        )
    # Rebuilt, so that the comparison sees the values the constructor keeps
    # (settings in float32, as the rules compute).
    expected = LossScale.from_config(saved).get_config()
    current = lookup.find(loss_scale, "loss_scale").get_config()
    if current == expected:
        return
    differences = [
        f"  {key}: checkpoint {expected.get(key, '(absent)')!r},"
        f" code {current.get(key, '(absent)')!r}"
        for key in sorted(set(expected) | set(current))
        if expected.get(key) != current.get(key)
    ]
    raise ValueError(
        "The checkpoint was written with another loss scale than the code's:\n"
        + "\n".join(differences)
        + "\nTo restore it as it was, build the target with"
        " `lossscale.LossScale.from_config(saved)`. To change the loss scale,"
        " restore that way and then replace the loss-scale state (e.g."
        " `state.replace(loss_scale=new)`); the saved counters do not carry over to"
        " another kind."
    )


def checkpoint_0_2_layout(
    config: dict[str, Any], *, batch_shape: tuple[int, ...] = ()
) -> dict[str, jax.ShapeDtypeStruct]:
    """The arrays a lossscale 0.2 checkpoint holds for a loss-scale state.

    0.2 packed a state's fields into one 1-D array per dtype (`int32_fields`
    held the counters, the int32 fields and the bools; `float32_fields` the
    float32 ones). Put this dict where the state's abstract tree goes in the
    restore target, restore, and pass what comes back to `from_checkpoint_0_2`.

    Args:
      config: the state's `get_config()` as 0.2 saved it.
      batch_shape: the leading shape of a state stacked for `pmap`, e.g.
        `(jax.local_device_count(),)`; `()` for one state.

    Returns:
      `{"int32_fields": ShapeDtypeStruct, ...}`, as 0.2 named its leaves.

    Deprecated in 0.4 as `lossscale.checkpoint_0_2_layout`: it is
    `lossscale.checkpoints.layout(target, "0.2")` now.
    """
    if not (
        isinstance(batch_shape, tuple)
        and all(isinstance(d, int) and not isinstance(d, bool) for d in batch_shape)
    ):
        raise TypeError(
            f"`batch_shape` must be a tuple of ints, got {batch_shape!r}; e.g."
            " `(jax.local_device_count(),)` for a state stacked for `pmap`."
        )
    return {
        name: jax.ShapeDtypeStruct(
            (*batch_shape, sum(size for _, size in slots)), dtype
        )
        for name, (dtype, slots) in _layout(_kind(_upgraded(config))).items()
    }


def from_checkpoint_0_2(
    arrays: Mapping[str, Any], config: dict[str, Any], *, where: str = "arrays"
) -> LossScale:
    """The state a lossscale 0.2 checkpoint holds, from its packed arrays.

    Args:
      arrays: the restored arrays, by the names `checkpoint_0_2_layout` gives.
      config: the state's `get_config()` as 0.2 saved it (a static scale's
        `"scale"` is now `"value"`; both are read).
      where: what to call `arrays` in a message.

    Returns:
      The state, of the kind and settings in `config`, with every field and
      counter as 0.2 had it (and 0.3's new ones at their defaults). Arrays with
      leading dimensions (a state stacked for `pmap`) give a state stacked so.

    Raises:
      ValueError: if `config` names no known kind, or `arrays` do not have the
        names and shapes of that kind's 0.2 layout.
      TypeError: if `arrays` holds the layout itself (the restore target), not
        restored arrays, or the arguments are swapped.

    Deprecated in 0.4 as `lossscale.from_checkpoint_0_2`: it is
    `lossscale.checkpoints.upgrade(restored, target)` now.
    """
    if isinstance(arrays, Mapping) and "kind" in arrays and is_packed(config):
        raise TypeError(
            "`from_checkpoint_0_2(arrays, config)` got the config as `arrays` and"
            " the arrays as `config`: swap them."
        )
    config = _upgraded(config)
    layout = _layout(_kind(config))
    _validate_arrays(arrays, layout, config["kind"], where)
    state = LossScale.from_config(config)
    specs = kind_fields.specs(type(state))
    values = {}
    batch: tuple[int, ...] | None = None
    for name, (_dtype, slots) in layout.items():
        packed = jnp.asarray(arrays[name])
        total = sum(size for _, size in slots)
        if packed.shape[-1:] != (total,) or batch not in (None, packed.shape[:-1]):
            raise ValueError(
                f"`{where}[{name!r}]` must have {total} elements (the 0.2 layout of"
                f" {config['kind']!r}) after the leading dimensions the other"
                f" arrays have, got shape {packed.shape}."
            )
        batch = packed.shape[:-1]  # a state stacked for `pmap` has some
        offset = 0
        for field, size in slots:
            value = packed[..., offset : offset + size]
            values[field] = value.reshape(batch + specs[field].shape)
            offset += size
    # The fields 0.2 did not have (`NOT_IN_0_2`) take their defaults, stacked alike.
    return checkpoint_0_3_0.from_saved(state, values)


def is_packed(value: Any) -> bool:
    """Whether `value` holds 0.2's packed arrays (keys named `*_fields`)."""
    return isinstance(value, Mapping) and any(
        isinstance(key, str) and key.endswith("_fields") for key in value
    )


def _validate_arrays(arrays: Any, layout: dict, kind: str, where: str) -> None:
    """Raises unless `arrays` (named `where`) holds restored arrays of `layout`."""
    if isinstance(arrays, LossScale):
        raise TypeError(
            f"`{where}` is a `{type(arrays).__name__}`, a 0.3 state already: use it"
            " as it is; `from_checkpoint_0_2` reads the packed arrays of a 0.2"
            " checkpoint."
        )
    if not isinstance(arrays, Mapping) or set(arrays) != set(layout):
        got = sorted(arrays) if isinstance(arrays, Mapping) else type(arrays).__name__

        def found(node: Any) -> bool:  # `layout`'s arrays, deeper inside `arrays`
            return is_packed(node) and set(node) == set(layout)

        paths, _ = jax.tree_util.tree_flatten_with_path(arrays, is_leaf=found)
        inside = [jax.tree_util.keystr(p) for p, node in paths if p and found(node)]
        there = f" They are at `{where}{inside[0]}`: pass that." if inside else ""
        raise ValueError(
            f"`{where}` must hold the 0.2 arrays {sorted(layout)} of a {kind!r}"
            f" state, got {got}; restore into `lossscale.checkpoints.layout(target,"
            f' "0.2")`.{there}'
        )
    for name in layout:
        if isinstance(arrays[name], jax.ShapeDtypeStruct):
            raise TypeError(
                f"`{where}[{name!r}]` is a `ShapeDtypeStruct`: `{where}` is the"
                " restore target from `lossscale.checkpoints.layout`, not what was"
                " restored. Put it in the target, restore the checkpoint, and pass"
                " the restored arrays (the tree the restore returns, at the same"
                " place)."
            )


def _upgraded(config: Any) -> dict[str, Any]:
    # 0.2 named a static scale's setting `scale`; 0.3 calls it `value`. Read
    # without a warning: this is 0.2's config, read as such.
    config = kind_validation.validated_config(config, known_kinds())
    return deprecation.upgraded_config(config, quietly=True)


def _kind(config: dict[str, Any]) -> type[LossScale]:
    kind = KINDS.get(config["kind"])  # a string: `_upgraded` checked it
    if kind is None:
        raise ValueError(
            "`config` must be a loss-scale config saved by 0.2, whose 'kind' is one"
            f" of {known_kinds()}; got {config!r}."
        )
    return kind


# The library's fields that 0.2's states did not have.
NOT_IN_0_2 = ("overflow_leaf", *ADDED_AFTER_0_3_0)


def _layout(kind: type[LossScale]) -> dict[str, tuple[np.dtype, list]]:
    """0.2's leaves: name -> (dtype, [(field, size), ...]), as 0.2 packed them."""
    order = [n for n in COUNTERS if n not in NOT_IN_0_2]
    order += [n for n in kind_fields.leaf_names(kind) if n not in COUNTERS]
    layout: dict[str, tuple[Any, list]] = {}
    for name in order:
        spec = kind_fields.specs(kind)[name]
        dtype = np.dtype(np.int32) if spec.dtype == np.bool_ else spec.dtype
        size = int(np.prod(spec.shape, dtype=np.int64))
        layout.setdefault(f"{dtype}_fields", (dtype, []))[1].append((name, size))
    return layout
