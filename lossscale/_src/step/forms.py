"""The check's reduction in each backend's form: XLA:CPU's, XLA:GPU's and the TPU's.

Each takes the floating-point leaves and their positions in the tree and returns
`(total, first)`: a float32 scalar that is finite exactly when every leaf is (with
`square`, the sum of squares), and the position of the first non-finite leaf, or -1.
Why each backend reads the gradients another way: design.md, "Checking finiteness".
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lossscale._src.step import unscaling

# Leaves with fewer elements are stacked by shape and dtype, larger ones reduced alone.
GROUP_BELOW = 4096
# Leaves to a stack: XLA fuses a stack of up to about 100 leaves (beyond, XLA:GPU
# writes it out), and XLA:CPU compiles one of 1000 leaves 3x slower than 16 of 64.
STACK = 64
_NONE = np.iinfo(np.int32).max  # "no leaf", while positions are compared by `min`

# The forms use `lax`, not `jnp`: all three are traced on every backend, at a few
# operations per leaf, and a `jnp` function costs several times a primitive's
# trace (design.md, "The step").


def grouped(arrays, positions, square):
    """XLA:CPU: large leaves reduced alone, small ones stacked by shape and dtype."""
    large, small = {}, {}
    for position, leaf in zip(positions, arrays, strict=True):
        if leaf.size < GROUP_BELOW:
            small.setdefault((leaf.shape, leaf.dtype), []).append((position, leaf))
        else:
            large.setdefault(leaf.dtype, []).append((position, leaf))
    order, probes = [], []
    # The scalars are stacked by dtype before any elementwise op: an op per leaf on
    # its reduced scalar would cost XLA:CPU a kernel per leaf.
    for dtype, group in large.items():
        values = [leaf for _, leaf in group]
        if square:
            probes.append(_stack([_sum_of_squares(v) for v in values]))
        elif dtype.itemsize < 4 and not jnp.issubdtype(dtype, jnp.complexfloating):
            probes.append(narrow_probes(values))
        else:
            probes.append(_zero_or_nan(_stack([_sum_of_zeros(v) for v in values])))
        order.extend(position for position, _ in group)
    for group in small.values():
        for start in range(0, len(group), STACK):
            chunk = group[start : start + STACK]
            probes.append(_stack_probes([leaf for _, leaf in chunk], square))
            order.extend(position for position, _ in chunk)
    probes = probes[0] if len(probes) == 1 else lax.concatenate(probes, 0)
    return _combine(probes, np.asarray(order, np.int32))


def narrow_probes(values: list[jax.Array]) -> jax.Array:
    """XLA:CPU's float32 probes of large 16-bit (or fp8) leaves of one dtype.

    A sum or an `or` per leaf, never a `max` or a `min`: of a sharded leaf, the
    devices' results are combined by an all-reduce, which drops a NaN from a `max`
    (design.md, "Checking finiteness").
    """
    if values[0].dtype == jnp.bfloat16:
        # Widened before the sum, which XLA:CPU then fuses (a bfloat16 sum it
        # does not).
        return _stack([_sum_of_zeros(v, wide=True) for v in values])
    # float16 (and fp8): XLA:CPU fuses neither their sums nor their converts into
    # a reduction, so a flag per leaf (a byte mask, written and read back).
    flags = _stack([_any_nonfinite(v) for v in values])
    nans = np.full(flags.shape, np.nan, np.float32)
    return lax.select(flags, nans, np.zeros(flags.shape, np.float32))


def partials(arrays, positions, square):
    """XLA:GPU: large leaves' rows reduced, small leaves stacked, a pass per 64."""
    small, parts = {}, []
    for position, leaf in zip(positions, arrays, strict=True):
        if leaf.size < GROUP_BELOW:
            small.setdefault((leaf.shape, leaf.dtype), []).append((position, leaf))
            continue
        rows = _row_probes(leaf, square)
        if square:  # a leaf's sum of squares overflows or not, in every form
            rows = lax.reduce_sum(rows, (0,)).reshape(1)
        parts.append((np.full(rows.size, position, np.int32), rows))
    for group in small.values():
        for start in range(0, len(group), STACK):
            chunk = group[start : start + STACK]
            owners = np.asarray([position for position, _ in chunk], np.int32)
            parts.append((owners, _stack_probes([leaf for _, leaf in chunk], square)))
    totals, firsts = [], []
    for start in range(0, len(parts), STACK):
        chunk = parts[start : start + STACK]
        probes = [vector for _, vector in chunk]
        probes = probes[0] if len(probes) == 1 else lax.concatenate(probes, 0)
        total, first = _combine(probes, np.concatenate([o for o, _ in chunk]))
        totals.append(total)
        firsts.append(lax.select(lax.lt(first, np.int32(0)), np.int32(_NONE), first))
    total, first = functools.reduce(lax.add, totals), functools.reduce(lax.min, firsts)
    return total, lax.select(lax.eq(first, np.int32(_NONE)), np.int32(-1), first)


def _row_probes(leaf: jax.Array, square: bool) -> jax.Array:
    """A large leaf reduced over its trailing axes: a float32 vector of row probes."""
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
        return _sum_of_squares(leaf, axes).reshape(-1)
    return _zero_or_nan(_sum_of_zeros(leaf, axes)).reshape(-1)


def each(arrays, positions, square):
    """TPU: one reduction per leaf, the probes combined as scalars (design.md)."""
    if square:
        probes = [_sum_of_squares(leaf) for leaf in arrays]
        bad = [lax.bitwise_not(lax.is_finite(probe)) for probe in probes]
    else:
        # A flag per leaf, then a float probe: the TPU compiler then needs no temp
        # buffer, where a sum of `x - x` needs one; stacking the flags costs it an
        # unfused concatenate and a temp buffer too (design.md).
        nan, zero = np.float32(np.nan), np.float32(0.0)
        bad = [_any_nonfinite(leaf) for leaf in arrays]
        probes = [lax.select(flag, nan, zero) for flag in bad]
    total = functools.reduce(lax.add, probes)
    first = np.int32(-1)
    for position, flag in zip(reversed(positions), reversed(bad), strict=True):
        first = lax.select(flag, np.int32(position), first)
    return total, jnp.asarray(first, jnp.int32)


def _any_nonfinite(leaf: jax.Array) -> jax.Array:
    """Whether an element is not finite: a complex one's parts, not its modulus."""
    if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
        finite = lax.bitwise_and(
            lax.is_finite(lax.real(leaf)), lax.is_finite(lax.imag(leaf))
        )
    else:
        finite = lax.is_finite(leaf)
    return lax.reduce_or(lax.bitwise_not(finite), _axes(leaf))


def _stack_probes(values: list[jax.Array], square: bool) -> jax.Array:
    """One float32 probe per leaf of a stack of leaves of one shape and dtype."""
    stack = _stack(values)
    axes = tuple(range(1, stack.ndim))
    if square:
        return _sum_of_squares(stack, axes)
    return _zero_or_nan(_sum_of_zeros(stack, axes))


def _combine(probes: jax.Array, owners: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """`(total, first)` from probes whose leaves' positions are `owners`.

    `first` is the smallest position of a non-finite probe, whatever the order of
    the probes (tree order, as `overflow_leaf` promises).
    """
    finite = lax.is_finite(probes)
    # Not `sum(probes)`: XLA rewrites a sum of sums into one sum over the leaves,
    # a second read of them beside the per-leaf one. One reduce for both: one
    # XLA:CPU kernel (design.md, "What XLA:CPU compiles").
    inf, none = np.full(probes.shape, np.inf, np.float32), np.full_like(owners, _NONE)
    both = (lax.select(finite, probes, inf), lax.select(finite, none, owners))
    total, first = lax.reduce(both, (np.float32(0), np.int32(_NONE)), _sum_min, (0,))
    return total, lax.select(lax.eq(first, np.int32(_NONE)), np.int32(-1), first)


def _sum_min(a: tuple, b: tuple) -> tuple:
    return lax.add(a[0], b[0]), lax.min(a[1], b[1])


def _sum_of_squares(values: jax.Array, axes: Any = None) -> jax.Array:
    """The sum of `|x|**2` over `axes` (all by default), in float32."""
    axes = _axes(values) if axes is None else axes
    values = values.astype(unscaling.wide_dtype(values.dtype))
    if jnp.issubdtype(values.dtype, jnp.complexfloating):
        real, imag = lax.real(values), lax.imag(values)
        squares = lax.add(lax.mul(real, real), lax.mul(imag, imag))
    else:
        squares = lax.mul(values, values)
    return _wide(lax.reduce_sum(squares, axes))


def _sum_of_zeros(values: jax.Array, axes: Any = None, wide: bool = False) -> jax.Array:
    """The sum of `x - x` over `axes`: 0, or NaN where an `x` is not finite.

    With `wide`, the zeros are summed in float32 (or wider).
    """
    axes = _axes(values) if axes is None else axes
    zeros = lax.sub(values, values)
    if wide:
        zeros = lax.convert_element_type(zeros, unscaling.wide_dtype(values.dtype))
    return lax.reduce_sum(zeros, axes)


def _zero_or_nan(sums: jax.Array) -> jax.Array:
    """Sums of `x - x` as float32, NaN where they are (complex: either part)."""
    if jnp.issubdtype(sums.dtype, jnp.complexfloating):
        sums = lax.add(lax.real(sums), lax.imag(sums))
    return _wide(sums)


def _wide(values: jax.Array) -> jax.Array:
    return lax.convert_element_type(values, np.float32)


def _axes(values: jax.Array) -> tuple[int, ...]:
    return tuple(range(values.ndim))


def _stack(values: list[jax.Array]) -> jax.Array:
    """`jnp.stack(values)`, in primitives."""
    values = [lax.reshape(v, (1, *v.shape)) for v in values]
    return values[0] if len(values) == 1 else lax.concatenate(values, 0)
