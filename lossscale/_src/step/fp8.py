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
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

OVERWRITE = "_overwrite_with_gradient"


class Split(NamedTuple):
    """A step's trees with the collection split off, once, where the step starts."""

    grads: Any  # the gradients without the collection
    params: Any  # the parameters without it (None if none were given)
    new: Any  # the collection's new values, from the gradients; None if absent
    old: Any  # its current values, from the parameters; None if absent


def split(grads: Any, params: Any) -> Split:
    """Splits the collection off `grads` and `params`, checking that they match.

    Raises:
      ValueError: if the collection is nested, the two collections' trees
        differ, or a new value's shape differs from its old value's.
      TypeError: if a new value is not floating point.
    """
    grads, new = split_off(grads, "grads")
    if params is None:
        if new is not None:
            raise ValueError(
                f"The gradients hold Flax's `{OVERWRITE}` collection: pass `params`"
                " too, whose old values a skipped step keeps."
            )
        return Split(grads, None, None, None)
    params, old = split_off(params, "params")
    if jax.tree.structure(new) != jax.tree.structure(old):
        raise ValueError(
            f"The gradients' and `params`' fp8 `{OVERWRITE}` collections must have"
            f" the same tree structure, got {jax.tree.structure(new)} and"
            f" {jax.tree.structure(old)}."
        )
    if new is not None:
        _validate_new_values(new, old)
    return Split(grads, params, new, old)


def refuse_accumulation(params: Any, opt_state: Any, owner: str) -> None:
    """Raises if `params` hold the collection and `opt_state` accumulates.

    `apply_gradients` and the `TrainState` write the collection on every applied
    call; under `optax.MultiSteps` that is every micro-step, where `wrap` writes
    their max once per optimizer step (`docs/design.md`, "fp8 metadata").
    """
    if not (isinstance(params, Mapping) and OVERWRITE in params):
        return
    nodes = jax.tree.leaves(
        opt_state, is_leaf=lambda node: isinstance(node, optax.MultiStepsState)
    )
    if any(isinstance(node, optax.MultiStepsState) for node in nodes):
        raise ValueError(
            f"{owner} got Flax's fp8 `{OVERWRITE}` collection and an"
            " `optax.MultiSteps` optimizer state: it would write the fp8 scales and"
            " amax histories on every micro-step, not once per optimizer step."
            " Accumulate inside `lossscale.wrap` instead: `tx ="
            " lossscale.wrap(optax.MultiSteps(inner, k))`, `updates, opt_state ="
            " tx.update(grads, opt_state, variables)` and"
            " `optax.apply_updates(variables, updates)`, which combines them with"
            " max until the inner optimizer steps."
        )


ACCUMULATED_OUTSIDE = (
    f"`optax.MultiSteps(lossscale.wrap(...))` accumulates Flax's fp8 `{OVERWRITE}`"
    " collection as gradients, averaging the scales and amax histories (and an"
    " unused op's -inf makes them NaN). Accumulate inside the wrap instead:"
    " `lossscale.wrap(optax.MultiSteps(inner, k))`, which combines them with max"
    " until the inner optimizer steps."
)


def refuse_accumulated_outside(state: optax.MultiStepsState) -> None:
    """Raises if an `optax.MultiSteps` state around a wrap accumulates the collection.

    `MultiSteps(wrap(...))` averages the fp8 values with the gradients, and an
    unused op's -inf makes them NaN for good.
    """
    if isinstance(state.acc_grads, Mapping) and OVERWRITE in state.acc_grads:
        raise ValueError(ACCUMULATED_OUTSIDE)


def trainable(params: Any) -> Any:
    """`params` without the collection: what an optimizer sees."""
    return split_off(params, "params")[0]


def split_off(tree: Any, name: str) -> tuple[Any, Any]:
    """`(tree without the collection, the collection)`; the latter None if absent."""
    if isinstance(tree, Mapping) and OVERWRITE in tree:
        rest = {key: value for key, value in tree.items() if key != OVERWRITE}
        return _like(tree, rest), tree[OVERWRITE]
    _refuse_nested(tree, name)
    return tree, None


def _validate_new_values(new: Any, old: Any) -> None:
    new_paths, _ = jax.tree_util.tree_flatten_with_path(new)
    for (path, value), before in zip(new_paths, jax.tree.leaves(old), strict=True):
        where = f"{OVERWRITE}{jax.tree_util.keystr(path)}"
        if not jnp.issubdtype(jnp.result_type(value), jnp.floating):
            raise TypeError(
                f"The new fp8 value at {where} has dtype {jnp.result_type(value)};"
                " fp8 scales and amax histories are floating point."
            )
        if jnp.shape(value) != jnp.shape(before):
            raise ValueError(
                f"The new fp8 value at {where} has shape {jnp.shape(value)}, the"
                f" variable has shape {jnp.shape(before)}: it would be broadcast"
                " into the variable. Give it the variable's shape."
            )


def merge(tree: Any, collection: Any) -> Any:
    """`tree` with the collection put back, once, where the step ends.

    Nothing is added if `collection` is None.
    """
    if collection is None:
        return tree
    return _like(tree, {**tree, OVERWRITE: collection})


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


def differences(written: Any, old: Any) -> Any:
    """What `optax.apply_updates` adds to `old` to give `written`.

    To within one rounding of the sum; -0.0 keeps an unchanged value bitwise.
    """
    return jax.tree.map(
        lambda new, old: jnp.where(new == old, -0.0, new - old), written, old
    )


def accumulated(pending: Any, new: Any, old: Any, stepped: jax.Array) -> tuple:
    """`(written, pending)` under `wrap(optax.MultiSteps(...))`, per micro-step.

    The new values combine with `pending` by max; on the micro-step where the
    inner optimizer steps (`stepped`) their max is written and `pending` starts
    afresh, on the others the old values stay.
    """
    pending = maximum(pending, new)
    written_ = jax.tree.map(
        lambda new, old: jnp.where(stepped, new, old), written(pending, old), old
    )
    return written_, jax.tree.map(lambda p: jnp.where(stepped, -jnp.inf, p), pending)


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
        return type(mapping)(items)  # type: ignore[call-arg]  # caught below
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
