"""How a loss-scale kind declares its array fields and its static settings."""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class field:  # noqa: N801 - used like `dataclasses.field`
    """Declares an array field of a loss-scale kind: part of its pytree's leaves.

    Use it in the body of a `lossscale.LossScale` subclass. The field holds an
    array of a fixed dtype and shape (a scalar by default), so a state goes in and
    out of `jax.jit` without recompiling; read it as an attribute, and get a state
    with new values from `state.replace(name=value)`.

    Args:
      dtype: the field's dtype, e.g. `jnp.float32`, `jnp.int32` or `jnp.bool_`.
      shape: the field's shape, a tuple of ints; `()` (a scalar) by default.

    Raises:
      TypeError: if `dtype` is not a numeric or boolean dtype, or `shape` is not
        a tuple of non-negative ints.

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale
      >>> class Halving(lossscale.LossScale):
      ...     scale = lossscale.field(jnp.float32)
      ...     def __init__(self, initial_scale=1024.0):
      ...         super().__init__(scale=initial_scale)
      ...     def adjust(self, grads_finite):
      ...         return self.replace(
      ...             scale=jnp.where(grads_finite, self.scale, self.scale / 2))
      >>> print(Halving().scale, Halving().scale.dtype)
      1024.0 float32
    """

    def __init__(self, dtype: Any, *, shape: tuple[int, ...] = ()):
        try:
            dtype = jnp.dtype(dtype)
        except TypeError:
            raise TypeError(
                "`field`: `dtype` must be a dtype such as `jnp.float32`, got"
                f" {dtype!r}."
            ) from None
        if not (jnp.issubdtype(dtype, jnp.number) or dtype == jnp.bool_):
            raise TypeError(
                f"`field`: `dtype` must be numeric or boolean, got {dtype}."
            )
        if not (
            isinstance(shape, tuple)
            and all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
            and all(d >= 0 for d in shape)
        ):
            raise TypeError(
                f"`field`: `shape` must be a tuple of non-negative ints, got {shape!r}."
            )
        self.dtype = dtype
        self.shape = shape
        self.size = int(np.prod(shape, dtype=np.int64))
        self.name: str | None = None
        self.index: int | None = None  # its position among the state's fields

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, state: Any, owner: type | None = None) -> Any:
        if state is None:
            return self
        return state._read(self)

    def __set__(self, state: Any, value: Any) -> None:
        raise AttributeError(
            f"`{type(state).__name__}` is immutable; use `state.replace("
            f"{self.name}=...)` or `lossscale.update` to get another state."
        )

    def __repr__(self) -> str:
        return f"field({self.dtype}, shape={self.shape})"

    @property
    def storage_dtype(self) -> jnp.dtype:
        """The dtype of the leaf that holds it: its own, int32 for a bool."""
        return jnp.dtype(jnp.int32) if self.dtype == jnp.bool_ else self.dtype

    def as_array(self, value: Any, owner: str, *, strict: bool) -> Any:
        """`value` as this field's array; `strict` refuses other (non-weak) dtypes.

        Construction converts any number (the constructor's job is to build the
        arrays); `replace` refuses a dtype other than the field's, which is almost
        always a mistake in a rule, except for weakly typed Python numbers.
        """
        array = jnp.asarray(value)
        weak = not hasattr(value, "dtype") or getattr(array, "weak_type", False)
        if array.dtype != self.dtype and strict and not weak:
            raise TypeError(
                f"`{owner}`: field `{self.name}` holds {self.dtype}, got a value of"
                f" dtype {array.dtype}. Cast it (`.astype(jnp.{self.dtype})`) or fix"
                " the arithmetic that changed its dtype."
            )
        if not _fits(array.shape, self.shape):
            if array.shape != ():
                raise ValueError(
                    f"`{owner}`: field `{self.name}` has shape {self.shape}, got a"
                    f" value of shape {array.shape}."
                )
            array = jnp.broadcast_to(array, self.shape)
        return array.astype(self.dtype)


class setting:  # noqa: N801 - used like `dataclasses.field`
    """Declares a static setting of a loss-scale kind: part of its tree structure.

    Use it in the body of a `lossscale.LossScale` subclass. A setting is a Python
    value (a number, string, bool, None or a tuple of them), compiled into the
    train step and kept by every pytree round trip, like Flax's
    `struct.field(pytree_node=False)`. Two states with other settings have other
    tree structures. `get_config` reports the settings, and `from_config` passes
    them back to the constructor by name. A setting named with a leading
    underscore (`_scale`) is private to the class: its config key drops the
    underscore (`scale`), so a public property may take the plain name.

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale
      >>> class Fixed(lossscale.LossScale):
      ...     _scale = lossscale.setting()
      ...     def __init__(self, scale=8.0):
      ...         super().__init__(_scale=float(scale))
      ...     @property
      ...     def scale(self):
      ...         return jnp.asarray(self._scale, jnp.float32)
      ...     def adjust(self, grads_finite):
      ...         return self
      >>> print(Fixed(4.0).get_config()["scale"], Fixed(4.0).scale)
      4.0 4.0
    """

    def __init__(self):
        self.name: str | None = None
        self.index: int | None = None  # its position among the state's settings

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @property
    def public_name(self) -> str:
        """The name in `get_config` and in the constructor: no leading underscore."""
        return self.name[1:] if self.name.startswith("_") else self.name

    def __get__(self, state: Any, owner: type | None = None) -> Any:
        if state is None:
            return self
        return state._settings[self.index]

    def __set__(self, state: Any, value: Any) -> None:
        raise AttributeError(
            f"`{type(state).__name__}` is immutable, and `{self.name}` is a setting:"
            " build a new state with the constructor to change it."
        )

    def __repr__(self) -> str:
        return f"setting(name={self.name!r})"

    def checked(self, value: Any, owner: str) -> Any:
        """`value`, after checking that it can be part of a tree structure."""
        if isinstance(value, np.ndarray | np.generic | jax.Array):
            raise TypeError(
                f"`{owner}`: setting `{self.name}` must be a Python value, got"
                f" {type(value).__name__}; settings are static (use `float(x)` or"
                " `int(x)`), and state that changes is a `lossscale.field`."
            )
        try:
            hash(value)
        except TypeError:
            raise TypeError(
                f"`{owner}`: setting `{self.name}` must be hashable (a number,"
                f" string, bool, None or a tuple of them), got {type(value).__name__}."
            ) from None
        return value


class Layout(NamedTuple):
    """Where each field lives: the leaves hold the fields packed by dtype.

    A state has one 1-D leaf per storage dtype (int32 holds int32 and bool
    fields), with the fields in declaration order: a dynamic loss scale is two
    leaves, not seven (design.md, "States").
    """

    dtypes: tuple[jnp.dtype, ...]  # of each leaf
    slots: dict[str, tuple[int, int]]  # field name -> (leaf, offset)

    @classmethod
    def of(cls, fields: tuple[field, ...]) -> Layout:
        """The layout of `fields`, in order."""
        dtypes: list[jnp.dtype] = []
        sizes: list[int] = []
        slots = {}
        for declared in fields:
            dtype = declared.storage_dtype
            if dtype not in dtypes:
                dtypes.append(dtype)
                sizes.append(0)
            leaf = dtypes.index(dtype)
            slots[declared.name] = (leaf, sizes[leaf])
            sizes[leaf] += declared.size
        return cls(tuple(dtypes), slots)

    def leaf_names(self) -> tuple[str, ...]:
        """Key names of the leaves: `int32_fields`, `float32_fields`, ..."""
        return tuple(f"{dtype}_fields" for dtype in self.dtypes)

    def pack(self, fields: tuple[field, ...], values: dict[str, Any]) -> tuple:
        """The leaves holding `values` (arrays of each field's dtype and shape)."""
        parts: list[list[Any]] = [[] for _ in self.dtypes]
        for declared in fields:
            value = values[declared.name]
            leaf = self.slots[declared.name][0]
            flat = value.astype(declared.storage_dtype)
            batch = flat.shape[: flat.ndim - len(declared.shape)]
            parts[leaf].append(flat.reshape(batch + (declared.size,)))
        return tuple(
            jnp.concatenate(pieces, axis=-1) if len(pieces) > 1 else pieces[0]
            for pieces in parts
        )

    def read(self, leaves: tuple, declared: field) -> Any:
        """The value of field `declared`, from the leaves."""
        index, offset = self.slots[declared.name]
        leaf = leaves[index]
        if not hasattr(leaf, "shape"):  # a sentinel some transformation put there
            return leaf
        batch = tuple(leaf.shape[:-1])
        if not hasattr(leaf, "__getitem__"):  # a shape struct from `eval_shape`
            return jax.ShapeDtypeStruct(batch + declared.shape, declared.dtype)
        if declared.shape == ():
            value = leaf[..., offset]
        else:
            value = leaf[..., offset : offset + declared.size]
            value = value.reshape(batch + declared.shape)
        return value != 0 if declared.dtype == jnp.bool_ else value


def declarations(
    cls: type, base: type
) -> tuple[tuple[field, ...], tuple[setting, ...]]:
    """The fields and settings of `cls`, `base`'s first, in declaration order."""
    fields: dict[str, field] = {}
    settings: dict[str, setting] = {}
    for klass in reversed(cls.__mro__):
        if not issubclass(klass, base):
            continue
        for name, value in vars(klass).items():
            if not isinstance(value, field | setting):
                continue
            if name in fields or name in settings:
                raise TypeError(
                    f"`{cls.__name__}` declares `{name}` again; a kind keeps the"
                    " fields and settings of the kinds it extends."
                )
            (fields if isinstance(value, field) else settings)[name] = value
    for name, declared in (*fields.items(), *settings.items()):
        if getattr(cls, name) is not declared:
            raise TypeError(f"`{cls.__name__}` hides its field or setting `{name}`.")
    if "kind" in fields or "kind" in settings:
        raise TypeError(f"`{cls.__name__}`: `kind` is the kind's name, not a field.")
    for group in (fields.values(), settings.values()):
        for index, declared in enumerate(group):
            if declared.index not in (None, index):
                raise TypeError(
                    f"`{cls.__name__}` reorders the fields of a kind it extends"
                    " (multiple inheritance); extend one kind only."
                )
            declared.index = index
    return tuple(fields.values()), tuple(settings.values())


def _fits(shape: tuple[int, ...], field_shape: tuple[int, ...]) -> bool:
    # Trailing dimensions: a state stacked by `pmap` or `vmap` has leading ones.
    return len(shape) >= len(field_shape) and tuple(
        shape[len(shape) - len(field_shape) :]
    ) == tuple(field_shape)
