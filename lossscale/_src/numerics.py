"""The numerics of checking and unscaling gradients, in as few passes as XLA allows.

Why each formulation is what it is, with the XLA measurements behind it, is in
`docs/design.md` ("Checking finiteness", "Unscaling").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from lossscale._src.base import LossScale


def inverse_scale(state: LossScale) -> jax.Array:
    """`1 / scale` in float32: gradients are multiplied by it (design.md, Unscaling)."""
    return jnp.ones([], jnp.float32) / state.scale


def always_one(state: LossScale) -> bool:
    """Whether the scale is 1 at every step (its static bounds are both 1).

    Such a scale (`NoOpLossScale`) leaves losses and gradients untouched.
    """
    return state.min_scale == 1.0 and state.max_scale == 1.0


def wide_dtype(dtype: Any) -> jnp.dtype:
    """`dtype` widened to at least float32, explicitly (strict promotion holds)."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.float32) if dtype.itemsize < 4 else dtype


def unscale(grads: Any, state: LossScale, params: Any = None) -> Any:
    """The gradients divided by the scale; `None` leaves pass through.

    Each leaf keeps its dtype, unless `params` has a wider one for it (float16
    gradients of float32 parameters): then it takes the parameter's.
    """
    if always_one(state):
        return grads
    inverse = inverse_scale(state)
    leaves, treedef = _flatten_keeping_none(grads)
    dtypes = _target_dtypes(leaves, treedef, params)
    return treedef.unflatten(
        [
            g if g is None else _unscaled(g, inverse).astype(dtype)
            for g, dtype in zip(leaves, dtypes, strict=True)
        ]
    )


@dataclasses.dataclass(frozen=True)
class Checked:
    """The check's result: whether all is finite, and which leaves are not.

    `leaf_flags[i]` says whether the leaf at `positions[i]` (in the order of the
    gradients flattened with `None` kept, `jax.tree.leaves(params)`'s) is finite;
    None when no leaf was checked.
    """

    finite: jax.Array
    leaf_flags: jax.Array | None
    positions: tuple[int, ...]

    def first_nonfinite(self) -> jax.Array:
        """The position of the first non-finite leaf, an int32; -1 if none."""
        if self.leaf_flags is None:
            return jnp.asarray(-1, jnp.int32)
        none = jnp.iinfo(jnp.int32).max
        positions = jnp.asarray(self.positions, jnp.int32)
        first = jnp.min(jnp.where(self.leaf_flags, jnp.int32(none), positions))
        return jnp.where(first == none, jnp.int32(-1), first)


def checked_after_unscaling(
    grads: Any, state: LossScale, params: Any = None
) -> Checked:
    """Whether `unscale(grads, state, params)` is finite: one pass over `grads`.

    Dividing by a scale >= 1 cannot overflow, so then the check reads `grads` as
    they are; below 1 it reduces the unscaled values, inf where they overflow.
    """
    leaves, _ = _flatten_keeping_none(grads)
    if state.min_scale < 1.0:
        unscaled = iter(_unscaled_leaves(grads, state, params))
        return check_leaves([g if g is None else next(unscaled) for g in leaves])
    checked = check_leaves(leaves)
    if state.min_scale == state.max_scale:  # a constant, checked when built
        return checked
    # A rule that breaks its own `min_scale` (a scale of 0) would put 0 * inf
    # into the parameters: one scalar keeps that step out.
    finite = checked.finite & jnp.isfinite(inverse_scale(state))
    return dataclasses.replace(checked, finite=finite)


def finite_after_unscaling(
    grads: Any, state: LossScale, params: Any = None
) -> jax.Array:
    """`checked_after_unscaling(...).finite`."""
    return checked_after_unscaling(grads, state, params).finite


def norm_after_unscaling(grads: Any, state: LossScale, params: Any = None) -> jax.Array:
    """The global norm of `unscale(grads, state, params)`: one pass over `grads`.

    It is NaN or inf exactly when an unscaled gradient is, so it doubles as the
    finiteness check. For scales >= 1 the squares are summed in the scaled
    domain, then the root is multiplied by `1 / scale` (design.md, Clipping).
    """
    if state.min_scale < 1.0:
        return jnp.sqrt(_sum_of_squares(_unscaled_leaves(grads, state, params)))
    wide = [g.astype(wide_dtype(g.dtype)) for g in jax.tree.leaves(grads)]
    return jnp.sqrt(_sum_of_squares(wide)) * inverse_scale(state)


def clip_to_norm(grads: Any, norm: jax.Array, max_norm: float) -> Any:
    """`optax.clip_by_global_norm(max_norm)` of `grads`, whose global norm is `norm`."""
    factor = jnp.where(norm < max_norm, jnp.ones([], norm.dtype), max_norm / norm)
    return jax.tree.map(lambda g: g * factor.astype(g.dtype), grads)


# Leaves with fewer elements are checked in groups, stacked by shape and dtype:
# one reduction per group instead of one per leaf (design.md, Checking finiteness).
GROUP_BELOW = 4096


def all_finite_leaves(leaves: list[Any]) -> jax.Array:
    """Whether every element of every floating-point leaf is finite."""
    return check_leaves(leaves).finite


def check_leaves(leaves: list[Any]) -> Checked:
    """Whether each floating-point leaf is finite, and all of them.

    Other leaves (None, integers, bools, and objects that are not arrays) are
    skipped. A leaf of 4096 elements or more is reduced on its own, in one read
    (two for 16-bit leaves); smaller leaves of one shape and dtype are stacked
    and reduced together, to one flag per leaf (design.md, Checking finiteness).
    """
    large, small = _groups(leaves)
    by_dtype = {}
    for position, leaf in large:
        by_dtype.setdefault(leaf.dtype, []).append((position, leaf))
    # Each leaf is reduced to a float32 probe, non-finite exactly when the leaf
    # is, and one `isfinite` over all probes gives the flags. The probes are
    # stacked by dtype before any elementwise op: an op per leaf on its reduced
    # scalar would cost XLA:CPU a kernel per leaf.
    positions, probes = [], []
    for dtype, group in by_dtype.items():
        values = [leaf for _, leaf in group]
        if dtype.itemsize < 4:
            # float16, bfloat16: two plain reductions, the fastest on XLA:CPU
            # (no float32 copy, which a sum of 16-bit values makes). Their
            # difference in float32 is finite exactly when both are.
            top = jnp.stack([jnp.max(v) for v in values]).astype(jnp.float32)
            low = jnp.stack([jnp.min(v) for v in values]).astype(jnp.float32)
            probes.append(top - low)
        else:
            # 0 where finite, NaN elsewhere; a sum of zeros cannot overflow.
            probes.append(_float32(jnp.stack([jnp.sum(v - v) for v in values])))
        positions.extend(position for position, _ in group)
    for group in small.values():
        # One reduction per stack: faster than max and min over a copy (design.md).
        values = jnp.stack([leaf for _, leaf in group])
        rows = jnp.sum(values - values, axis=tuple(range(1, values.ndim)))
        probes.append(_float32(rows))
        positions.extend(position for position, _ in group)
    if not probes:
        return Checked(jnp.asarray(True), None, ())
    leaf_flags = jnp.isfinite(jnp.concatenate(probes))
    return Checked(jnp.all(leaf_flags), leaf_flags, tuple(positions))


def _float32(zeros_or_nan: jax.Array) -> jax.Array:
    """Sums of `x - x` as float32, NaN where they are (complex: either part)."""
    if jnp.iscomplexobj(zeros_or_nan):
        zeros_or_nan = jnp.abs(zeros_or_nan)
    return zeros_or_nan.astype(jnp.float32)


def _groups(leaves: list[Any]) -> tuple[list[tuple[int, jax.Array]], dict]:
    """The floating-point leaves to reduce, with their positions in `leaves`.

    Returns `(large, small)`: each leaf of 4096 elements or more, as
    `(position, leaf)` in order; and the smaller ones, grouped by shape and
    dtype (`{(shape, dtype): [(position, leaf), ...]}`) to be stacked. Other
    leaves (None, integers, bools, and objects that are not arrays) and
    zero-size ones are left out: nothing in them can be non-finite.
    """
    large, small = [], {}
    for position, leaf in enumerate(leaves):
        if leaf is None or (
            not hasattr(leaf, "dtype") and not isinstance(leaf, float | complex)
        ):
            continue  # not an array: e.g. a function or a name in an Equinox model
        leaf = jnp.asarray(leaf)
        if leaf.size == 0 or not jnp.issubdtype(leaf.dtype, jnp.inexact):
            continue
        if leaf.size < GROUP_BELOW:
            small.setdefault((leaf.shape, leaf.dtype), []).append((position, leaf))
        else:
            large.append((position, leaf))
    return large, small


def _grouped(leaves: list[Any]) -> tuple[list[jax.Array], list[jax.Array]]:
    """The arrays to reduce: each large leaf, and the small ones stacked.

    Small leaves are stacked (a new leading axis) by shape and dtype rather than
    concatenated, so that leaves sharded alike stay sharded: no collective moves
    them.
    """
    large, small = _groups(leaves)
    stacks = [jnp.stack([leaf for _, leaf in group]) for group in small.values()]
    return [leaf for _, leaf in large], stacks


def _unscaled(grad: jax.Array, inverse: jax.Array) -> jax.Array:
    """The one definition of an unscaled value, at least float32 wide.

    The check and the applied branch both use it, so they agree exactly.
    """
    wide = wide_dtype(grad.dtype)
    return grad.astype(wide) * inverse.astype(wide)


def _unscaled_leaves(grads: Any, state: LossScale, params: Any) -> list[jax.Array]:
    """The unscaled leaves, wide, inf where they overflow their target dtype."""
    leaves, treedef = _flatten_keeping_none(grads)
    dtypes = _target_dtypes(leaves, treedef, params)
    inverse = inverse_scale(state)
    return [
        _inf_where_overflowing(_unscaled(g, inverse), dtype)
        for g, dtype in zip(leaves, dtypes, strict=True)
        if g is not None
    ]


def _inf_where_overflowing(value: jax.Array, dtype: Any) -> jax.Array:
    """`value`, with inf where rounding it to `dtype` would overflow."""
    if value.dtype == dtype:
        return value
    # A compare with the rounding threshold, not a round trip through `dtype`:
    # XLA:GPU removes round trips (excess precision), which hid the overflow.
    # Values at or above max + ulp/2 round to inf.
    finfo = jnp.finfo(dtype)
    top_ulp = 2.0 ** (finfo.maxexp - 1) * float(finfo.eps)
    threshold = jnp.asarray(float(finfo.max) + top_ulp / 2, value.dtype)
    return jnp.where(
        jnp.abs(value) < threshold, value, jnp.asarray(jnp.inf, value.dtype)
    )


def _target_dtypes(leaves: list[Any], treedef: Any, params: Any) -> list[Any]:
    """The dtype each gradient leaf is unscaled into (design.md, Unscaling)."""
    dtypes = [None if g is None else jnp.result_type(g) for g in leaves]
    if params is None:
        return dtypes
    for i, (dtype, param) in enumerate(
        zip(dtypes, treedef.flatten_up_to(params), strict=True)
    ):
        param_dtype = getattr(param, "dtype", None)
        if (
            dtype is not None
            and param_dtype is not None
            and jnp.issubdtype(param_dtype, jnp.floating)
            and jnp.dtype(param_dtype).itemsize > dtype.itemsize
        ):
            dtypes[i] = jnp.dtype(param_dtype)
    return dtypes


def _sum_of_squares(leaves: list[jax.Array]) -> jax.Array:
    """The sum of the squares of `leaves` (at least float32), in float32.

    Grouped as the finiteness check is: one sum per group of small leaves.
    """
    large, stacks = _grouped(leaves)
    sums = [
        jnp.sum(jnp.square(values)).astype(jnp.float32) for values in large + stacks
    ]
    return jnp.sum(jnp.stack(sums)) if sums else jnp.zeros([], jnp.float32)


def _flatten_keeping_none(tree: Any) -> tuple[list[Any], Any]:
    return jax.tree.flatten(tree, is_leaf=lambda x: x is None)
