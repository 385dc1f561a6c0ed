"""Flax's fp8 `_overwrite_with_gradient` collection: new values, not gradients.

Flax's fp8 layers keep their scales and amax histories in that collection, at the top
level of the variables (`{"params": ..., "_overwrite_with_gradient": ...}`); the
"gradients" of those leaves are their new values. They are never unscaled, clipped,
checked or fed to the optimizer, and they are written only on applied steps
(`docs/design.md`, "fp8 metadata").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

OVERWRITE = "_overwrite_with_gradient"


def split(tree: Any, name: str) -> tuple[Any, Any]:
    """`(tree without the collection, the collection)`; the latter None if absent."""
    if isinstance(tree, Mapping) and OVERWRITE in tree:
        rest = {key: value for key, value in tree.items() if key != OVERWRITE}
        return _like(tree, rest), tree[OVERWRITE]
    _refuse_nested(tree, name)
    return tree, None


def merge(tree: Any, overwrite: Any) -> Any:
    """`tree` with the collection `overwrite` put back (nothing if it is None)."""
    if overwrite is None:
        return tree
    return _like(tree, {**tree, OVERWRITE: overwrite})


def written(new: Any, old: Any) -> Any:
    """The values an applied step writes: `new`, except where no op produced them.

    An fp8 op that did not run in a step gives its metadata the default cotangent:
    zeros for float32 metadata, -inf for Flax's max-accumulating `fm32` type. A
    leaf that is all zeros, and elements that are not finite, keep their old
    values; a used op never produces either (its scale is > 0, its history holds
    the old history shifted by one).
    """

    def leaf(new, old):
        new = jax.lax.convert_element_type(new, old.dtype)
        produced = jnp.isfinite(new) & jnp.any(new != 0)
        return jnp.where(produced, new, old)

    return jax.tree.map(leaf, new, old)


def unproduced_like(tree: Any) -> Any:
    """-inf everywhere: the start of a max over micro-steps (see `wrap`)."""
    return jax.tree.map(lambda x: jnp.full_like(x, -jnp.inf), tree)


def maximum(a: Any, b: Any) -> Any:
    """Elementwise max of two collections: how fp8 metadata combines over steps."""
    return jax.tree.map(
        lambda a, b: jnp.maximum(a, jax.lax.convert_element_type(b, a.dtype)), a, b
    )


def _like(mapping: Mapping, items: dict) -> Any:
    try:
        return type(mapping)(items)
    except TypeError:  # a mapping type that does not take a dict
        return items


def _refuse_nested(tree: Any, name: str) -> None:
    paths, _ = jax.tree_util.tree_flatten_with_path(tree)
    for path, _leaf in paths:
        if any(getattr(key, "key", None) == OVERWRITE for key in path):
            raise ValueError(
                f"`{name}` holds Flax's `{OVERWRITE}` collection below its top level"
                f" (at {jax.tree_util.keystr(path)}). Pass the whole variables dict,"
                f" `{{'params': ..., '{OVERWRITE}': ...}}`, as Flax's fp8 layers"
                " create it."
            )
