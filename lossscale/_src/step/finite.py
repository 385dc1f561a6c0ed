"""The finiteness check: whether the gradients are finite, and where not, in one pass.

It has a form per backend (`per_backend`), since XLA:CPU, XLA:GPU and the TPU compiler
each read the gradients fastest in another way (design.md, "Checking finiteness").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from lossscale._src import validation
from lossscale._src.state.kind import LossScale
from lossscale._src.step import forms
from lossscale._src.step import unscaling


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
    axis_name: validation.AxisName | None = None,
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
    grads_finite, loss_finite, first = _agree_with_index(
        grads_finite, loss_finite, first, axis_name
    )
    return Checked(grads_finite, loss_finite, first, root)


def all_finite_leaves(leaves: list[Any]) -> jax.Array:
    """Whether every element of every floating-point leaf is finite."""
    return jnp.isfinite(_reduce(leaves, square=False)[0])


def agree(flags: jax.Array, axis_name: validation.AxisName | None) -> jax.Array:
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
    order = tuple(positions)

    def formulation(reduce):
        return lambda *arrays: reduce(list(arrays), order, square)

    return per_backend(
        *arrays,
        cpu=formulation(forms.grouped),
        gpu=formulation(forms.partials),
        tpu=formulation(forms.each),
    )


def per_backend(*args: Any, cpu: Callable, gpu: Callable, tpu: Callable) -> Any:
    """`cpu(*args)`, `gpu(*args)` or `tpu(*args)`, chosen where the step is lowered.

    All three are traced, one is lowered; other backends take the CPU's.
    """
    # The CPU's form as the default only: named as well, it would be traced twice.
    return jax.lax.platform_dependent(*args, cuda=gpu, rocm=gpu, tpu=tpu, default=cpu)
