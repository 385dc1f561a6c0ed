"""The two sides of a skip made one type: weak types and `shard_map`'s varying axes.

A `lax.cond`'s branches must return values of one type, and a select's two
operands too: the skipped side (the carried state, negative zeros) may be less
weakly typed or vary over fewer `shard_map` axes than the applied side, whose
kinds are read while it is traced (`kinds`), joined (`join`) and given to both
(`cast`), with JAX's public operations only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax


class Kind(NamedTuple):
    """What a value's type says beyond its shape and dtype, for a skip's two sides."""

    weak: bool  # a weak type (a Python scalar's)
    varying: frozenset  # the `shard_map` axes it varies over


def kinds(fn: Callable, *args: Any) -> tuple[Any, Any]:
    """`fn(*args)`'s outputs' shapes, and their `Kind`s: read while tracing, not run.

    `jax.eval_shape`'s own results do not say which `shard_map` axes a value
    varies over: its tracers do.
    """
    found = []

    def read(*args):
        out = fn(*args)
        found.append(jax.tree.map(kind, out))
        return out

    return jax.eval_shape(read, *args), found[0]


def kind(x: Any) -> Kind:
    """`x`'s `Kind`."""
    return Kind(jax.typeof(x).weak_type, varying(x))


def join(a: Any, b: Any) -> Any:
    """The kind of a select of two values: weak if both are, varying where either."""

    def one(x: Kind, y: Kind) -> Kind:
        return Kind(x.weak and y.weak, x.varying | y.varying)

    return jax.tree.map(one, a, b, is_leaf=lambda x: isinstance(x, Kind))


def cast(tree: Any, kinds: Any) -> Any:
    """`tree`'s values made of the given kinds (never less weak or varying)."""

    def one(x, want):
        if jax.typeof(x).weak_type and not want.weak:
            x = jax.lax.convert_element_type(x, jax.typeof(x).dtype)
        missing = want.varying - varying(x)
        return pcast(x, tuple(sorted(missing))) if missing else x

    return jax.tree.map(one, tree, kinds)


def varying(x: Any) -> frozenset:
    """The `shard_map` axes `x` varies over, found with JAX's public operations.

    Outside `shard_map` there are none. Inside, making `x` vary over an axis it
    varies over already is refused (a `ValueError`), over another it is not (the
    result is unused, and dropped).
    """
    axes = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ())
    found = set()
    for axis in axes:
        try:
            pcast(x, (axis,))
        except ValueError:
            found.add(axis)
    return frozenset(found)


def pcast(x: Any, axes: tuple[str, ...]) -> Any:
    """`x` made varying over `axes` (`lax.pcast` from jax 0.8.2, `lax.pvary` before)."""
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)  # type: ignore[attr-defined]  # jax < 0.8.2
