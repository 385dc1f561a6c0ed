"""Naming the gradient leaf that `overflow_leaf` points at."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale._src import validation


def leaf_path(params: Any, index: Any) -> str | None:
    """The path of leaf `index` of the gradients, as `jax.tree_util.keystr` writes it.

    Names the leaf that `lossscale.metrics(opt_state)["overflow_leaf"]` points
    at: an index into `jax.tree.leaves(grads)`, so `None` leaves are not
    counted. Of `params`, only the leaves that can have a gradient are counted
    (floating-point arrays and numbers), so an Equinox model, whose functions
    have `None` gradients, gives the same paths as its gradients. Run it on
    the host, after the step: it reads `index`'s value.

    Args:
      params: the gradients, or any tree with their leaves: the parameters, a
        Flax variables dict, an Equinox or NNX model.
      index: an int, or an int32 scalar array such as `metrics(...)
        ["overflow_leaf"]`; -1 (no overflow yet) gives None.

    Returns:
      The path (e.g. `"['dense']['kernel']"`), or None for -1.

    Raises:
      TypeError: if `index` is not an integer scalar (a bool, an array of one
        per device, a value traced inside `jax.jit`).
      ValueError: if `index` is below -1 or past the last leaf.

    Examples:
      >>> import jax.numpy as jnp, lossscale
      >>> params = {"act": None, "dense": {"b": jnp.zeros(2), "w": jnp.ones(3)}}
      >>> print(lossscale.diagnostics.leaf_path(params, 1))
      ['dense']['w']
      >>> print(lossscale.diagnostics.leaf_path(params, -1))
      None
    """
    position = _index(index, params)
    paths = [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
        if _inexact(leaf)
    ]
    if position == -1:
        return None
    if not 0 <= position < len(paths):
        raise ValueError(
            f"`index` is {position}, but `params` has {len(paths)} leaves that can"
            f" have a gradient: it must be -1 (no overflow yet) or in [0,"
            f" {len(paths)}). Pass the tree whose gradients the step checked (or"
            " those gradients)."
        )
    return paths[position]


def _index(index: Any, params: Any) -> int:
    """`index` as a Python int; raises naming the mistake if it is not one."""
    if isinstance(index, jax.core.Tracer):
        raise TypeError(
            "`leaf_path` runs on the host, after the step: `index` is a traced"
            " value (inside `jax.jit`, `grad` or `vmap`). Return"
            ' `metrics(opt_state)["overflow_leaf"]` from the step, and call'
            " `leaf_path(params, index)` on the concrete value outside it."
        )
    try:
        value = np.asarray(index)
    except (TypeError, ValueError):  # a tree of arrays of several shapes
        value = np.asarray(None)
    swapped = " (The arguments are `leaf_path(params, index)`.)" * (
        validation.is_number(params) and not validation.is_number(index)
    )
    if value.dtype == np.bool_:
        raise TypeError(
            f"`index` must be an integer, got the bool {index!r}: bools are not"
            ' indices. Pass `metrics(opt_state)["overflow_leaf"]`.'
        )
    if value.shape != ():
        per_device = (
            " An index per device (a state stacked by `pmap`) holds the same value"
            " on every device under `axis_name`: pass `index[0]`."
            if value.ndim == 1 and np.issubdtype(value.dtype, np.integer)
            else ""
        )
        raise TypeError(
            f"`index` must be an integer scalar, got shape {value.shape}.{per_device}"
            f"{swapped}"
        )
    if not (
        np.issubdtype(value.dtype, np.integer) or isinstance(index, numbers.Integral)
    ):
        raise TypeError(
            "`index` must be an integer scalar (e.g. `metrics(opt_state)"
            f'["overflow_leaf"]`), got {index!r}.{swapped}'
        )
    return int(value)


def _inexact(leaf: Any) -> bool:
    """Whether `leaf` can have a gradient: a floating-point array or number."""
    if isinstance(leaf, float | complex):
        return True
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)
