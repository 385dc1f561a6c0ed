"""A kind's fields: declared with `field`, laid out as leaves and settings, cast.

A kind's array fields are its pytree leaves, named and in a fixed order; its
settings are its tree structure (`docs/design.md`, "States").
"""

from __future__ import annotations

import dataclasses
import functools
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


class FieldSpec(NamedTuple):
    """What `field` declared: an array's dtype and shape, or a static setting."""

    dtype: np.dtype | None  # None for a static setting
    shape: tuple[int, ...]

    @property
    def static(self) -> bool:
        return self.dtype is None


def field(  # noqa: D417 - `*positional` only refuses 0.2's spelling
    *positional: Any,
    dtype: Any = None,
    shape: tuple[int, ...] = (),
    static: bool = False,
    default: Any = dataclasses.MISSING,
    kw_only: Any = dataclasses.MISSING,
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
    if static:
        if dtype is not None or shape != ():
            raise TypeError(
                "`field`: a static field (a setting) takes no `dtype` or `shape`; got"
                f" dtype={dtype!r}, shape={shape!r}. Drop them, or drop"
                " `static=True` for an array field."
            )
        spec = FieldSpec(None, ())
    else:
        spec = FieldSpec(_validated_dtype(dtype), _validated_shape(shape))
    if default is not dataclasses.MISSING and not spec.static:
        if not (default is None or isinstance(default, bool | int | float)):
            raise TypeError(
                "`field`: an array field's `default` must be a Python number or bool"
                f" (cast to {spec.dtype} and broadcast to {spec.shape}), or None for"
                f" a value `__post_init__` sets; got {type(default).__name__}."
            )
    if default is not dataclasses.MISSING and spec.static:
        # A setting is immutable (part of the tree structure), so a list default
        # is no shared mutable state: store it as the tuple it becomes anyway.
        default = validated_setting(default, "field(static=True)", "default")
    return dataclasses.field(
        default=default, kw_only=kw_only, metadata={METADATA_KEY: spec}
    )


# Keyword-only as documented; `*positional` is there to explain 0.2's spelling.
field.__signature__ = inspect.signature(field).replace(
    parameters=[
        p
        for p in inspect.signature(field).parameters.values()
        if p.kind is not inspect.Parameter.VAR_POSITIONAL
    ]
)


def _validated_dtype(dtype: Any) -> np.dtype:
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


def _validated_shape(shape: Any) -> tuple[int, ...]:
    if not (
        isinstance(shape, tuple)
        and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        )
    ):
        raise TypeError(
            f"`field`: `shape` must be a tuple of non-negative ints, got {shape!r}."
        )
    return shape


def declared_specs(cls: type) -> dict[str, FieldSpec]:
    """The fields of dataclass `cls` by name, in order, with their specs."""
    return {
        f.name: f.metadata[METADATA_KEY]
        for f in dataclasses.fields(cls)
        if METADATA_KEY in f.metadata
    }


def as_array(spec: FieldSpec, value: Any, owner: str, name: str, *, like=None) -> Any:
    """`value` as an array of `spec`'s dtype and shape.

    Construction (no `like`) casts any number and takes a leading batch shape
    (a state stacked for `pmap`). `replace` passes the current value as `like`:
    then another dtype that is not weak is refused, and any shape but `like`'s.
    """
    if isinstance(value, jax.ShapeDtypeStruct):
        return value
    array = jnp.asarray(value)
    if like is not None:
        weak = not hasattr(value, "dtype") or getattr(array, "weak_type", False)
        if array.dtype != spec.dtype and not weak:
            raise TypeError(
                f"`{owner}`: field `{name}` holds {spec.dtype}, got a value of dtype"
                f" {array.dtype}. Cast it (`.astype(jnp.{spec.dtype})`) or fix the"
                " arithmetic that changed its dtype."
            )
        target = tuple(like.shape)
    else:
        ndim = len(spec.shape)
        trailing = (
            tuple(array.shape[array.ndim - ndim :]) if array.ndim >= ndim else None
        )
        target = tuple(array.shape) if trailing == spec.shape else spec.shape
    if array.shape not in (target, ()):
        raise ValueError(
            f"`{owner}`: field `{name}` has shape {target}, got a value of shape"
            f" {array.shape}; a rule must keep each field's shape."
        )
    return jnp.broadcast_to(array, target).astype(spec.dtype)


def validated_setting(value: Any, owner: str, name: str) -> Any:
    """`value`, if it can be a static setting; JSON's lists become tuples."""
    if isinstance(value, list):
        value = tuple(value)
    if isinstance(value, tuple):
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


# -- the fields laid out: leaves and settings --------------------------------------


def lay_out(kind: type, counters: tuple[str, ...]) -> None:
    """Reads a kind's fields once, and registers it as the pytree of its leaves.

    The leaves are the array fields, the kind's own first (checkpoints and
    `repr` open with `.scale`), then `counters`; the settings are the tree's
    structure. Unflattening skips `__init__`: leaves may be tracers, shape
    structs, shardings or other placeholders.
    """
    kind._specs = declared_specs(kind)
    arrays = [n for n, s in kind._specs.items() if not s.static]
    kind._leaves = tuple(n for n in arrays if n not in counters) + counters
    kind._settings = tuple(n for n, s in kind._specs.items() if s.static)
    kind._get_leaves = staticmethod(_getter(kind._leaves))
    kind._get_settings = staticmethod(_getter(kind._settings))
    jax.tree_util.register_pytree_with_keys(
        kind, _flatten_with_keys, functools.partial(unflatten, kind), flatten
    )


def specs(kind: type) -> dict[str, FieldSpec]:
    """A kind's fields by name, in declaration order, with their specs."""
    return kind._specs


def leaf_names(kind: type) -> tuple[str, ...]:
    """A kind's array fields in leaf order."""
    return kind._leaves


def setting_names(kind: type) -> tuple[str, ...]:
    """A kind's static settings, in declaration order."""
    return kind._settings


def flatten(state: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """`(leaves, settings)` of a state."""
    kind = type(state)
    return kind._get_leaves(state), kind._get_settings(state)


def unflatten(kind: type, settings: tuple, leaves) -> Any:
    """A state of `kind` from its settings and leaves, without `__init__`."""
    state = object.__new__(kind)
    values = state.__dict__
    values.update(zip(kind._leaves, leaves, strict=True))
    values.update(zip(kind._settings, settings, strict=True))
    return state


def _getter(names: tuple[str, ...]):
    # `attrgetter` reads in C: flattening runs on every jitted call's dispatch.
    if not names:
        return lambda state: ()
    get = operator.attrgetter(*names)
    return (lambda state: (get(state),)) if len(names) == 1 else get


def _flatten_with_keys(state: Any):
    leaves, settings = flatten(state)
    keys = map(jax.tree_util.GetAttrKey, type(state)._leaves)
    return tuple(zip(keys, leaves, strict=True)), settings
