"""Unscaling: the gradients divided by the loss scale, into their target dtypes.

One definition of an unscaled value (`_unscaled`), used both by the applied step
(`unscale`) and by what the finiteness check reads (`values_to_check`), so that the
two agree exactly. Why each choice: `docs/design.md`, "Unscaling".
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from lossscale._src.state.kind import LossScale


def inverse_scale(state: LossScale) -> jax.Array:
    """`1 / scale` in float32: gradients are multiplied by it (design.md, Unscaling)."""
    return jnp.ones([], jnp.float32) / state.scale


def always_one(state: LossScale) -> bool:
    """Whether the scale is 1 at every step (its static bounds are both 1).

    Such a scale (`NoOpLossScale`) leaves losses and gradients untouched.
    """
    return state.min_scale == 1.0 and state.max_scale == 1.0


def can_overflow(state: LossScale) -> bool:
    """Whether dividing by the scale can overflow a gradient: a scale below 1."""
    return state.min_scale < 1.0


def wide_dtype(dtype: Any) -> jnp.dtype:
    """`dtype` widened to at least float32, explicitly (strict promotion holds)."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.float32) if dtype.itemsize < 4 else dtype


def overflow_threshold(dtype: Any) -> float:
    """The smallest magnitude that rounds to inf in `dtype`: max + ulp/2."""
    finfo = jnp.finfo(dtype)
    top_ulp = 2.0 ** (finfo.maxexp - 1) * float(finfo.eps)
    return float(finfo.max) + top_ulp / 2


def unscale(grads: Any, state: LossScale, params: Any = None) -> Any:
    """The gradients divided by the scale; `None` leaves pass through.

    Each leaf keeps its dtype, unless `params` has a wider one for it (float16
    gradients of float32 parameters): then it takes the parameter's, whatever the
    scale (with a scale of 1 nothing else changes).
    """
    if always_one(state) and params is None:
        return grads
    leaves, treedef = _flatten_keeping_none(grads)
    dtypes = _target_dtypes(leaves, treedef, params)
    if always_one(state):
        return treedef.unflatten(
            [
                g if g is None or g.dtype == to else lax.convert_element_type(g, to)
                for g, to in zip(leaves, dtypes, strict=True)
            ]
        )
    inverse = inverse_scale(state)
    return treedef.unflatten(
        [
            g if g is None else lax.convert_element_type(_unscaled(g, inverse), dtype)
            for g, dtype in zip(leaves, dtypes, strict=True)
        ]
    )


def clip_to_norm(grads: Any, norm: jax.Array, max_norm: float) -> Any:
    """`optax.clip_by_global_norm(max_norm)` of `grads`, whose global norm is `norm`."""
    factor = jnp.where(norm < max_norm, jnp.ones([], norm.dtype), max_norm / norm)
    return jax.tree.map(lambda g: g * factor.astype(g.dtype), grads)


def values_to_check(grads: Any, state: LossScale, params: Any = None) -> list[Any]:
    """What the finiteness check reads: a value per leaf of `jax.tree.leaves(grads)`.

    The gradients as they are where dividing by the scale cannot overflow (see
    `can_overflow`); else their unscaled values (wide), inf where they overflow
    the dtype `unscale` gives them.
    """
    if not can_overflow(state):
        return jax.tree.leaves(grads)
    leaves, treedef = _flatten_keeping_none(grads)
    dtypes = _target_dtypes(leaves, treedef, params)
    inverse = inverse_scale(state)
    return [
        _inf_where_overflowing(_unscaled(g, inverse), dtype)
        if jnp.issubdtype(jnp.result_type(g), jnp.inexact)
        else g
        for g, dtype in zip(leaves, dtypes, strict=True)
        if g is not None
    ]


def _unscaled(grad: jax.Array, inverse: jax.Array) -> jax.Array:
    """The one definition of an unscaled value, at least float32 wide."""
    # `lax`, not `jnp`: a primitive or two per leaf of the step's trace.
    wide = wide_dtype(grad.dtype)
    if inverse.dtype != wide:
        inverse = lax.convert_element_type(inverse, wide)
    # The scalar first, as in `step._unfused`: one XLA:CPU kernel per leaf shape.
    return lax.mul(inverse, lax.convert_element_type(grad, wide))


def _inf_where_overflowing(value: jax.Array, dtype: Any) -> jax.Array:
    """`value`, with inf where rounding it to `dtype` would overflow."""
    if value.dtype == dtype:
        return value
    # A compare with the rounding threshold, not a round trip through `dtype`:
    # XLA:GPU removes round trips (excess precision), which hid the overflow.
    threshold = jnp.asarray(overflow_threshold(dtype), value.dtype)
    return jnp.where(
        jnp.abs(value) < threshold, value, jnp.asarray(jnp.inf, value.dtype)
    )


def _target_dtypes(leaves: list[Any], treedef: Any, params: Any) -> list[Any]:
    """The dtype each gradient leaf is unscaled into (design.md, Unscaling)."""
    dtypes = [None if g is None else jnp.result_type(g) for g in leaves]
    if params is None:
        return dtypes
    for i, param in enumerate(treedef.flatten_up_to(params)):
        wide = getattr(param, "dtype", None)
        if (
            dtypes[i] is not None
            and wide is not None
            and jnp.issubdtype(wide, jnp.floating)
        ):
            dtypes[i] = max(dtypes[i], jnp.dtype(wide), key=lambda d: d.itemsize)
    return dtypes


def _flatten_keeping_none(tree: Any) -> tuple[list[Any], Any]:
    return jax.tree.flatten(tree, is_leaf=lambda x: x is None)
