"""A kind's fields: declared with `field`, cast, and laid out as a pytree.

A kind's array fields are its pytree leaves, named and in a fixed order; its
settings are its tree structure (`docs/design.md`, "States").
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lossscale._src import deprecation

# The key of a field's spec in `dataclasses.field(metadata=...)`.
METADATA_KEY = "lossscale"
_MISSING = dataclasses.MISSING
# What an array field's `default` may be: a Python number or bool (cast), None
# (`__post_init__` sets the value) or no default.
_ARRAY_DEFAULTS = (bool, int, float, type(None), type(_MISSING))


class FieldSpec(NamedTuple):
    """What `field` declared: an array's dtype and shape; a setting's dtype is None."""

    dtype: np.dtype | None
    shape: tuple[int, ...] = ()


def field(  # noqa: D417 - `*positional` only refuses 0.2's spelling
    *positional: Any,
    dtype: Any = None,
    shape: tuple[int, ...] = (),
    static: bool = False,
    default: Any = _MISSING,
    kw_only: Any = _MISSING,
) -> Any:
    """Declares a field of a loss-scale kind: an array leaf or a static setting.

    An array field is a pytree leaf of a fixed dtype and shape; a static field
    (`static=True`) is a setting: a Python value compiled into the step and
    reported by `get_config`, like `flax.struct.field(pytree_node=False)`.

    Args:
      dtype: an array field's dtype (`jnp.float32`, `jnp.int32`, `jnp.bool_`,
        ...), one JAX keeps as is: int64 and float64 only with `jax_enable_x64`.
      shape: an array field's shape; `()` by default.
      static: declare a setting instead: no `dtype` or `shape`; its value is a
        number, string, bool, None or a tuple of them.
      default: the value when the constructor is not given one: for an array
        field a Python number or bool (cast), or None for one `__post_init__`
        sets; for a setting its value (a list becomes a tuple, as from JSON).
      kw_only: `False` lets the constructor take it by position.

    Returns:
      A `dataclasses.field`, to assign in the class body.

    Raises:
      TypeError: if an argument is passed by position; `dtype` is missing, not
        numeric or boolean, or not kept by JAX; `shape` is not a tuple of
        non-negative ints; a static field gets a `dtype` or `shape`; or a
        `default` is not a value such a field can hold.

    Examples:
      >>> import jax, jax.numpy as jnp, lossscale
      >>> class Halving(lossscale.LossScale, kind="doctest.halving"):
      ...     scale: jax.Array = lossscale.field(dtype=jnp.float32, default=1024.0)
      ...     floor: float = lossscale.field(static=True, default=1.0)
      ...     def rule(self, grads_finite):
      ...         halved = jnp.maximum(self.scale / 2, self.floor)
      ...         return self.replace(scale=jnp.where(grads_finite, self.scale, halved))
      >>> state = Halving(scale=8.0)
      >>> print(state.scale, state.scale.dtype, state.get_config())
      8.0 float32 {'kind': 'doctest.halving', 'floor': 1.0}
    """
    if positional:
        raise TypeError(
            "`field` takes keywords only, e.g. `scale: jax.Array ="
            " lossscale.field(dtype=jnp.float32, default=1.0)` or `floor: float ="
            " lossscale.field(static=True, default=1.0)`; got"
            f" {len(positional)} by position (0.2's `lossscale.field(jnp.float32)`"
            " is `lossscale.field(dtype=jnp.float32)`, annotated:"
            f" {deprecation.MIGRATION})."
        )
    if static and (dtype is not None or shape != ()):
        raise TypeError(
            "`field`: a static field (a setting) takes no `dtype` or `shape`; got"
            f" dtype={dtype!r}, shape={shape!r}. Drop them, or drop"
            " `static=True` for an array field."
        )
    spec = FieldSpec(None) if static else FieldSpec(_dtype(dtype), _shape(shape))
    if static and default is not _MISSING:
        # A setting is immutable (part of the tree structure), so a list default
        # is no shared mutable state: store it as the tuple it becomes anyway.
        default = validated_setting(default, "field(static=True)", "default")
    elif not (static or isinstance(default, _ARRAY_DEFAULTS)):
        raise TypeError(
            "`field`: an array field's `default` must be a Python number or bool"
            f" (cast to {spec.dtype} and broadcast to {spec.shape}), or None for"
            f" a value `__post_init__` sets; got {type(default).__name__}."
        )
    metadata = {METADATA_KEY: spec}
    return dataclasses.field(default=default, kw_only=kw_only, metadata=metadata)


# Keyword-only as documented; `*positional` is there to explain 0.2's spelling.
_signature = inspect.signature(field)
_keywords = list(_signature.parameters.values())[1:]
field.__signature__ = _signature.replace(parameters=_keywords)  # type: ignore[attr-defined]


def _dtype(dtype: Any) -> np.dtype:
    if dtype is None:
        raise TypeError(
            "`field`: an array field needs `dtype=`, e.g."
            " `lossscale.field(dtype=jnp.float32)`; for a static setting pass"
            " `static=True`."
        )
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"`field`: `dtype` must be a dtype such as `jnp.float32`, got {dtype!r}."
        ) from None
    if not (jnp.issubdtype(dtype, jnp.number) or dtype == np.bool_):
        raise TypeError(f"`field`: `dtype` must be numeric or boolean, got {dtype}.")
    kept = jax.dtypes.canonicalize_dtype(dtype)
    if kept != dtype:
        raise TypeError(
            f"`field`: JAX stores {dtype} as {kept} while `jax_enable_x64` is off, so"
            f" the field could never hold {dtype}; declare `dtype=jnp.{kept}`."
        )
    return dtype


def _shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, tuple) and all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        return shape
    raise TypeError(
        f"`field`: `shape` must be a tuple of non-negative ints, got {shape!r}."
    )


def as_array(spec: FieldSpec, value: Any, owner: str, name: str, like: Any) -> Any:
    """`value` as an array of `spec`'s dtype and shape.

    Construction (`like` None) casts any number and takes a leading batch shape
    (a state stacked for `pmap`). `replace` passes the current value as `like`:
    if it is an array, another dtype that is not weak is refused, and any shape
    but `like`'s.
    """
    if isinstance(value, jax.ShapeDtypeStruct):
        return value
    array = jnp.asarray(value)
    if hasattr(like, "shape"):
        weak = not hasattr(value, "dtype") or getattr(array, "weak_type", False)
        if array.dtype != spec.dtype and not weak:
            raise TypeError(
                f"`{owner}`: field `{name}` holds {spec.dtype}, got a value of dtype"
                f" {array.dtype}. Cast it (`.astype(jnp.{spec.dtype})`) or fix the"
                " arithmetic that changed its dtype."
            )
        target = tuple(like.shape)
    else:  # a shorter shape's tail cannot equal `spec.shape`
        trailing = array.shape[array.ndim - len(spec.shape) :]
        target = array.shape if trailing == spec.shape else spec.shape
    if array.shape not in (target, ()):
        raise ValueError(
            f"`{owner}`: field `{name}` has shape {target}, got a value of shape"
            f" {array.shape}; a rule must keep each field's shape."
        )
    return jnp.broadcast_to(array, target).astype(spec.dtype)


def validated_setting(value: Any, owner: str, name: str) -> Any:
    """`value`, if it can be a static setting; JSON's lists become tuples."""
    if isinstance(value, list | tuple):
        return tuple(validated_setting(v, owner, name) for v in value)
    if isinstance(value, np.ndarray | np.generic | jax.Array):
        raise TypeError(
            f"`{owner}`: setting `{name}` must be a Python value, got"
            f" {type(value).__name__}; settings are static (use `float(x)` or"
            " `int(x)`), and state that changes is an array field"
            " (`lossscale.field(dtype=...)`)."
        )
    if not (value is None or isinstance(value, bool | int | float | str)):
        raise TypeError(
            f"`{owner}`: setting `{name}` must be a number, string, bool, None or a"
            f" tuple of them (it is compiled into the step and saved as JSON), got"
            f" {type(value).__name__}."
        )
    return value


def lay_out(kind: Any, counters: tuple[str, ...]) -> None:
    """Reads a kind's fields once, and registers it as the pytree of its leaves.

    The leaves are the array fields, the kind's own first (checkpoints and
    `repr` open with `.scale`), then `counters`; the settings are the tree's
    structure. Unflattening skips `__init__`: leaves may be tracers, shape
    structs, shardings or other placeholders.
    """
    fields = dataclasses.fields(kind)
    kind._specs = {f.name: f.metadata[METADATA_KEY] for f in fields}
    kind._positional = tuple(f.name for f in fields if not f.kw_only)
    arrays = [n for n, s in kind._specs.items() if s.dtype is not None]
    kind._leaves = leaves = tuple(n for n in arrays if n not in counters) + counters
    kind._settings = tuple(n for n, s in kind._specs.items() if s.dtype is None)
    names, count = leaves + kind._settings, len(leaves)
    # One `attrgetter` (in C) of at least the five counters, so always a tuple:
    # flattening runs on every jitted call's dispatch.
    get = operator.attrgetter(*names)
    keys = tuple(map(jax.tree_util.GetAttrKey, leaves))

    def flatten(state):
        values = get(state)
        return values[:count], values[count:]

    def flatten_with_keys(state):
        values = get(state)
        return tuple(zip(keys, values[:count], strict=True)), values[count:]

    def unflatten(settings, children):
        state = object.__new__(kind)
        state.__dict__.update(zip(names, (*children, *settings), strict=True))
        return state

    jax.tree_util.register_pytree_with_keys(kind, flatten_with_keys, unflatten, flatten)


def specs(kind: Any) -> dict[str, FieldSpec]:
    """A kind's fields by name, in declaration order, with their specs."""
    return kind._specs


def leaf_names(kind: Any) -> tuple[str, ...]:
    """A kind's array fields in leaf order."""
    return kind._leaves
