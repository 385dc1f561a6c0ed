"""The finiteness check: whether the gradients are finite, and where not, in one pass.

It has a form per backend (`per_backend`), since XLA:CPU, XLA:GPU and the TPU compiler
each read the gradients fastest in another way (design.md, "Checking finiteness").
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

from lossscale._src import checks
from lossscale._src import unscaling
from lossscale._src.kind import LossScale


@dataclasses.dataclass(frozen=True)
class Checked:
    """What one pass over the gradients found, agreed over `axis_name`.

    Attributes:
      grads_finite: bool scalar, whether every unscaled gradient is finite.
      loss_finite: bool scalar, whether the loss is (True if none was given).
      first: int32 scalar, the position in `jax.tree.leaves(grads)` of the first
        non-finite leaf; -1 if none.
      norm: with `norm=True`, the unscaled gradients' global norm; else None.
    """

    grads_finite: jax.Array
    loss_finite: jax.Array
    first: jax.Array
    norm: jax.Array | None = None


def check(
    values: list[Any],
    state: LossScale,
    *,
    loss: jax.Array | None = None,
    axis_name: checks.AxisName | None = None,
    norm: bool = False,
) -> Checked:
    """Whether the unscaled gradients (and `loss`) are finite, and where not.

    `values` are `unscaling.values_to_check(grads, state, params)`. With `norm`,
    the sum of squares is the check (design.md, "Clipping in the check's pass").
    """
    total, first = _reduce(values, square=norm)
    grads_finite = jnp.isfinite(total)
    scaled = not unscaling.can_overflow(state)  # `values` are the scaled gradients
    if scaled and state.min_scale != state.max_scale:
        # A rule that breaks its own `min_scale` (a scale of 0) would put 0 * inf
        # into the parameters: one scalar keeps that step out.
        grads_finite = grads_finite & jnp.isfinite(unscaling.inverse_scale(state))
    root = None
    if norm:
        root = jnp.sqrt(total)
        root = root * unscaling.inverse_scale(state) if scaled else root
    loss_finite = jnp.asarray(True) if loss is None else jnp.isfinite(loss)
    agreed = _agree_with_index(grads_finite, loss_finite, first, axis_name)
    return Checked(*agreed, root)


def all_finite_leaves(leaves: list[Any]) -> jax.Array:
    """Whether every element of every floating-point leaf is finite."""
    total, _ = _reduce(leaves, square=False)
    return jnp.isfinite(total)


def agree(flags: jax.Array, axis_name: checks.AxisName | None) -> jax.Array:
    """Boolean flags, True only where they hold on every device of `axis_name`."""
    if axis_name is None:
        return flags
    return jax.lax.pmin(flags.astype(jnp.int32), axis_name) == 1


def _agree_with_index(grads_finite, loss_finite, first, axis_name):
    """The flags agreed over `axis_name`, and the smallest leaf index (-1: none)."""
    if axis_name is None:
        return grads_finite, loss_finite, first
    none = jnp.iinfo(jnp.int32).max
    values = jnp.stack(
        [
            grads_finite.astype(jnp.int32),
            loss_finite.astype(jnp.int32),
            jnp.where(first < 0, jnp.int32(none), first),
        ]
    )
    grads_finite, loss_finite, first = jax.lax.pmin(values, axis_name)
    return grads_finite == 1, loss_finite == 1, jnp.where(first == none, -1, first)


# -- the reduction, per backend -------------------------------------------------------


def _reduce(leaves: list[Any], *, square: bool) -> tuple[jax.Array, jax.Array]:
    """`(total, first)`: non-finite where a floating-point leaf is; the first, or -1."""
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

    All three are traced, one is lowered; other backends take the CPU's.
    """
    return jax.lax.platform_dependent(
        *args, cpu=cpu, cuda=gpu, rocm=gpu, tpu=tpu, default=cpu
    )


# Leaves with fewer elements are stacked by shape and dtype, larger ones reduced alone.
GROUP_BELOW = 4096
# XLA:GPU fuses a stack of up to this many leaves; beyond, it writes the stack out.
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
            # float16, bfloat16: two plain reductions, XLA:CPU's fastest; `t - t`
            # is 0 or NaN, so the probe cannot overflow as `max - min` could.
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
    """XLA:GPU: large leaves' rows reduced, small leaves stacked, then a pass per 64."""
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
        rows = _sum_of_squares(leaf, axes)
    else:
        rows = _as_float32(jnp.sum(leaf - leaf, axis=axes))
    return rows.reshape(-1)


def _each(arrays, positions, square):
    """TPU: one reduction per leaf, the probes combined as scalars (design.md)."""
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
    """One float32 probe per leaf of a stack of leaves of one shape and dtype."""
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
    values = values.astype(unscaling.wide_dtype(values.dtype))
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
