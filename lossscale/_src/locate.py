"""Saying where an overflow happened: the gradient leaf, by its path."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import numpy as np


def leaf_path(params: Any, index: Any) -> str | None:
    """The path of leaf `index` of `params`, as `jax.tree_util.keystr` writes it.

    Names the leaf that `lossscale.metrics(opt_state)["overflow_leaf"]` points
    at. Run it on the host, after the step: it reads `index`'s value.

    Args:
      params: the parameters (or any tree with their structure: the gradients,
        a Flax variables dict, an Equinox model).
      index: an int, or an int32 scalar array such as `metrics(...)
        ["overflow_leaf"]`; -1 (no overflow yet) gives None.

    Returns:
      The path (e.g. `"['dense']['kernel']"`), or None for -1.

    Raises:
      TypeError: if `index` is not an integer scalar.
      ValueError: if `index` is below -1 or past the last leaf.

    Examples:
      >>> import jax.numpy as jnp, lossscale
      >>> params = {"dense": {"bias": jnp.zeros(2), "kernel": jnp.ones((3, 2))}}
      >>> print(lossscale.leaf_path(params, 1))
      ['dense']['kernel']
      >>> print(lossscale.leaf_path(params, -1))
      None
    """
    value = np.asarray(index)
    if value.shape != () or not (
        np.issubdtype(value.dtype, np.integer) or isinstance(index, numbers.Integral)
    ):
        raise TypeError(
            "`index` must be an integer scalar (e.g. `metrics(opt_state)"
            f'["overflow_leaf"]`), got {index!r}.'
        )
    # `None` counts as a leaf, as in the step's count: Equinox's filtered
    # parameters have None where the model has a function.
    paths = jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: x is None)
    position = int(value)
    if position == -1:
        return None
    if not 0 <= position < len(paths):
        raise ValueError(
            f"`index` is {position}, but `params` has {len(paths)} leaves: it must be"
            f" -1 (no overflow yet) or in [0, {len(paths)}). Pass the tree whose"
            " gradients the step checked."
        )
    return jax.tree_util.keystr(paths[position][0])
