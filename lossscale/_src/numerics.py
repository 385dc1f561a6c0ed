"""The numerics of checking and unscaling gradients, in one pass over them.

The check is formulated per backend (`lax.platform_dependent`, chosen where the step
is lowered): what reads the gradients once in the fewest passes differs between
XLA:CPU, XLA:GPU and the TPU compiler. Why each formulation is what it is, with the
compiled programs behind it, is in `docs/design.md` ("Checking finiteness",
"Unscaling").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lossscale._src.kind import LossScale


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
    """What one pass over the gradients found.

    Attributes:
      finite: bool scalar, whether every unscaled gradient is finite.
      first: int32 scalar, the position in `jax.tree.leaves(grads)` of the first
        leaf holding a non-finite value; -1 if none.
      norm: with `norm=True`, the global norm of the unscaled gradients (NaN or
        inf exactly when a gradient is, or when a square overflows); else None.
    """

    finite: jax.Array
    first: jax.Array
    norm: jax.Array | None = None


def check(
    grads: Any, state: LossScale, params: Any = None, *, norm: bool = False
) -> Checked:
    """Whether `unscale(grads, state, params)` is finite, and where not: one pass.

    Dividing by a scale >= 1 cannot overflow, so then the check reads `grads` as
    they are; below 1 it reduces the unscaled values, inf where they overflow
    their target dtype. With `norm`, the sum of squares is the check (design.md,
    Clipping): summed in the scaled domain, its root times `1 / scale`.
    """
    if state.min_scale < 1.0:
        leaves = _unscaled_leaves(grads, state, params)
        total, first = _reduce(leaves, square=norm)
        if norm:
            return Checked(jnp.isfinite(total), first, jnp.sqrt(total))
        return Checked(jnp.isfinite(total), first)
    total, first = _reduce(jax.tree.leaves(grads), square=norm)
    finite = jnp.isfinite(total)
    if state.min_scale != state.max_scale:
        # A rule that breaks its own `min_scale` (a scale of 0) would put 0 * inf
        # into the parameters: one scalar keeps that step out.
        finite = finite & jnp.isfinite(inverse_scale(state))
    if norm:
        return Checked(finite, first, jnp.sqrt(total) * inverse_scale(state))
    return Checked(finite, first)


def all_finite_leaves(leaves: list[Any]) -> jax.Array:
    """Whether every element of every floating-point leaf is finite."""
    total, _ = _reduce(leaves, square=False)
    return jnp.isfinite(total)


def clip_to_norm(grads: Any, norm: jax.Array, max_norm: float) -> Any:
    """`optax.clip_by_global_norm(max_norm)` of `grads`, whose global norm is `norm`."""
    factor = jnp.where(norm < max_norm, jnp.ones([], norm.dtype), max_norm / norm)
    return jax.tree.map(lambda g: g * factor.astype(g.dtype), grads)


# -- the reduction, per backend -------------------------------------------------------


def _reduce(leaves: list[Any], *, square: bool) -> tuple[jax.Array, jax.Array]:
    """`(total, first)` over the floating-point leaves of `leaves`.

    `total` (float32) is non-finite exactly when a leaf is: the sum of per-leaf
    probes that are 0 or NaN (`square=False`), or the sum of squares. `first` is the
    position in `leaves` of the first leaf whose probe is non-finite, or -1.
    Other leaves (None, integers, bools, objects that are not arrays) and
    zero-size ones are skipped: nothing in them can be non-finite.
    """
    positions, arrays = [], []
    for position, leaf in enumerate(leaves):
        if leaf is None or (
            not hasattr(leaf, "dtype") and not isinstance(leaf, float | complex)
        ):
            continue  # not an array: e.g. a function in an Equinox model
        leaf = jnp.asarray(leaf)
        if leaf.size and jnp.issubdtype(leaf.dtype, jnp.inexact):
            positions.append(position)
            arrays.append(leaf)
    if not arrays:
        return jnp.zeros([], jnp.float32), jnp.asarray(-1, jnp.int32)
    positions = tuple(positions)

    def formulation(reduce):
        return lambda *arrays: reduce(list(arrays), positions, square)

    return per_backend(
        *arrays,
        cpu=formulation(_grouped),
        gpu=formulation(_partials),
        tpu=formulation(_each),
    )


def per_backend(*args: Any, cpu: Callable, gpu: Callable, tpu: Callable) -> Any:
    """`cpu(*args)`, `gpu(*args)` or `tpu(*args)`, chosen where the step is lowered.

    All three are traced; only the one for the backend the program is compiled for
    is lowered (`jax.lax.platform_dependent`). Other backends take the CPU's.
    """
    return jax.lax.platform_dependent(
        *args, cpu=cpu, cuda=gpu, rocm=gpu, tpu=tpu, default=cpu
    )


# XLA:CPU: leaves with fewer elements are stacked by shape and dtype, one reduction
# per stack; larger ones are reduced alone (design.md, Checking finiteness).
GROUP_BELOW = 4096
# XLA:GPU fuses a stack of up to this many leaves into its reduction; beyond, it
# writes the stack out (design.md).
GPU_STACK = 64


def _grouped(arrays, positions, square, stack_limit=None):
    """Large leaves alone, small ones stacked (at most `stack_limit` to a stack)."""
    large, small = {}, {}
    for position, leaf in zip(positions, arrays, strict=True):
        key = (leaf.shape, leaf.dtype)
        if leaf.size < GROUP_BELOW:
            small.setdefault(key, []).append((position, leaf))
        else:
            large.setdefault(leaf.dtype, []).append((position, leaf))
    order, probes = [], []
    # The scalars are stacked by dtype before any elementwise op: an op per leaf on
    # its reduced scalar would cost XLA:CPU a kernel per leaf.
    for dtype, group in large.items():
        values = [leaf for _, leaf in group]
        if square:
            probes.append(jnp.stack([_sum_of_squares(v) for v in values]))
        elif dtype.itemsize < 4 and not jnp.issubdtype(dtype, jnp.complexfloating):
            # float16, bfloat16: two plain reductions, the fastest on XLA:CPU (no
            # float32 copy, which a sum of 16-bit values makes); `t - t` is 0 or
            # NaN, so the probe cannot overflow as `max - min` could.
            top = jnp.stack([jnp.max(v) for v in values]).astype(jnp.float32)
            low = jnp.stack([jnp.min(v) for v in values]).astype(jnp.float32)
            probes.append((top - top) + (low - low))
        else:
            probes.append(_as_float32(jnp.stack([jnp.sum(v - v) for v in values])))
        order.extend(position for position, _ in group)
    for group in small.values():
        step = stack_limit or len(group)
        for start in range(0, len(group), step):
            chunk = group[start : start + step]
            probes.append(_stack_probes([leaf for _, leaf in chunk], square))
            order.extend(position for position, _ in chunk)
    return _combine(jnp.concatenate(probes), order)


def _partials(arrays, positions, square):
    """XLA:GPU: each large leaf reduced to a short vector, then one final pass.

    A large leaf's first stage reduces its rows (over its trailing axes), which
    XLA fuses into the kernel that produces the gradient inside a train step;
    alone, one kernel per leaf, where a full reduction takes two. Small leaves
    are stacked by shape. The short vectors and the stacks' probes are then
    checked in one kernel per up to `GPU_STACK` of them (design.md).
    """
    small, parts = {}, []
    for position, leaf in zip(positions, arrays, strict=True):
        if leaf.size < GROUP_BELOW:
            small.setdefault((leaf.shape, leaf.dtype), []).append((position, leaf))
        else:
            parts.append(([position], _row_probes(leaf, square)))
    for group in small.values():
        for start in range(0, len(group), GPU_STACK):
            chunk = group[start : start + GPU_STACK]
            values = [leaf for _, leaf in chunk]
            parts.append(([p for p, _ in chunk], _stack_probes(values, square)))
    totals, firsts = [], []
    for start in range(0, len(parts), GPU_STACK):
        chunk = parts[start : start + GPU_STACK]
        probes = jnp.concatenate([vector for _, vector in chunk])
        # Which leaf each element of `probes` belongs to, and where it ends.
        owners, ends = [], []
        for owned, vector in chunk:
            per_leaf = vector.size // len(owned)
            for position in owned:
                owners.append(position)
                ends.append((ends[-1] if ends else 0) + per_leaf)
        finite = jnp.isfinite(probes)
        bad = jnp.argmin(finite).astype(jnp.int32)  # the first False
        leaf = jnp.sum(bad >= jnp.asarray(np.asarray(ends, np.int32)))
        owner = jnp.asarray(np.asarray(owners, np.int32))[leaf]
        totals.append(jnp.sum(jnp.where(finite, probes, jnp.float32(jnp.inf))))
        firsts.append(jnp.where(jnp.all(finite), jnp.int32(-1), owner))
    total = totals[0] if len(totals) == 1 else jnp.sum(jnp.stack(totals))
    if len(firsts) == 1:
        return total, firsts[0]
    firsts = jnp.stack(firsts)
    none = np.iinfo(np.int32).max
    first = jnp.min(jnp.where(firsts < 0, jnp.int32(none), firsts))
    return total, jnp.where(first == none, jnp.int32(-1), first)


def _row_probes(leaf: jax.Array, square: bool) -> jax.Array:
    """A large leaf reduced over its trailing axes: a float32 vector of row probes.

    Only existing axes are reduced (a leaf sharded along any of them stays so);
    a 1-D leaf is cut into rows of a divisor of its length.
    """
    if leaf.ndim == 1:
        columns = max(
            (c for c in range(1024, 16385) if leaf.size % c == 0), default=leaf.size
        )
        leaf = leaf.reshape(leaf.size // columns, columns)
    # The fewest trailing axes holding at least 1024 elements each row.
    split = leaf.ndim - 1
    while split > 0 and math.prod(leaf.shape[split:]) < 1024:
        split -= 1
    axes = tuple(range(split, leaf.ndim))
    if square:
        rows = _sum_of_squares(leaf, axes)
    else:
        rows = _as_float32(jnp.sum(leaf - leaf, axis=axes))
    return rows.reshape(-1)


def _each(arrays, positions, square):
    """TPU: one reduction per leaf, the probes combined as scalars.

    A TPU runs scalar ops on its scalar unit: combining them costs no vector op,
    where stacking leaves costs a relayout each (design.md).
    """
    # `lax`, not `jnp`: this form is traced on every backend, a few ops per leaf.
    if square:
        probes = [_sum_of_squares(leaf) for leaf in arrays]
        bad = [~lax.is_finite(probe) for probe in probes]
    else:
        # A flag per leaf, then a float probe: the TPU compiler then needs no temp
        # buffer, where a sum of `x - x` needs one (design.md).
        nan, zero = np.float32(np.nan), np.float32(0.0)
        bad = [_any_nonfinite(leaf) for leaf in arrays]
        probes = [lax.select(flag, nan, zero) for flag in bad]
    total = probes[0]
    for probe in probes[1:]:
        total = lax.add(total, probe)
    first = np.int32(-1)
    for position, flag in zip(reversed(positions), reversed(bad), strict=True):
        first = lax.select(flag, np.int32(position), first)
    return total, jnp.asarray(first, jnp.int32)


def _any_nonfinite(leaf: jax.Array) -> jax.Array:
    if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
        leaf = lax.abs(leaf)  # inf or NaN where either part is
    return lax.reduce_or(lax.bitwise_not(lax.is_finite(leaf)), range(leaf.ndim))


def _stack_probes(values: list[jax.Array], square: bool) -> jax.Array:
    """One float32 probe per leaf of a stack of leaves of one shape and dtype.

    Stacked (a new leading axis), not concatenated, so that leaves sharded alike
    stay sharded: no collective moves them.
    """
    stack = jnp.stack(values)
    axes = tuple(range(1, stack.ndim))
    if square:
        return _sum_of_squares(stack, axes)
    return _as_float32(jnp.sum(stack - stack, axis=axes))


def _combine(probes: jax.Array, order: list[int]) -> tuple[jax.Array, jax.Array]:
    """`(total, first)` from per-leaf probes at the positions `order`."""
    none = np.iinfo(np.int32).max
    finite = jnp.isfinite(probes)
    positions = jnp.asarray(np.asarray(order, np.int32))
    first = jnp.min(jnp.where(finite, jnp.int32(none), positions))
    # Not `sum(probes)`: XLA rewrites a sum of sums into one sum over the leaves,
    # a second read of them beside the per-leaf one.
    total = jnp.sum(jnp.where(finite, probes, jnp.float32(jnp.inf)))
    return total, jnp.where(first == none, jnp.int32(-1), first)


def _sum_of_squares(values: jax.Array, axes: Any = None) -> jax.Array:
    """The sum of `|x|**2` over `axes` (all by default), in float32."""
    values = values.astype(wide_dtype(values.dtype))
    if jnp.issubdtype(values.dtype, jnp.complexfloating):
        squares = jnp.square(values.real) + jnp.square(values.imag)
    else:
        squares = jnp.square(values)
    return jnp.sum(squares, axis=axes).astype(jnp.float32)


def _as_float32(zeros_or_nan: jax.Array) -> jax.Array:
    """Sums of `x - x` as float32, NaN where they are (complex: either part)."""
    if jnp.iscomplexobj(zeros_or_nan):
        zeros_or_nan = jnp.abs(zeros_or_nan)
    return zeros_or_nan.astype(jnp.float32)


# -- unscaling -------------------------------------------------------------------------


def _unscaled(grad: jax.Array, inverse: jax.Array) -> jax.Array:
    """The one definition of an unscaled value, at least float32 wide.

    The check and the applied step both use it, so they agree exactly.
    """
    wide = wide_dtype(grad.dtype)
    return grad.astype(wide) * inverse.astype(wide)


def _unscaled_leaves(grads: Any, state: LossScale, params: Any) -> list[Any]:
    """The unscaled leaves (None dropped), wide, inf where they overflow."""
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


def _flatten_keeping_none(tree: Any) -> tuple[list[Any], Any]:
    return jax.tree.flatten(tree, is_leaf=lambda x: x is None)
