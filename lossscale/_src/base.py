"""`LossScale`: the base class of every loss-scale kind, built-in or user-defined."""

from __future__ import annotations

import abc
from typing import Any
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from lossscale._src.fields import Layout
from lossscale._src.fields import declarations
from lossscale._src.fields import field
from lossscale._src.fields import setting
from lossscale._src.registry import build
from lossscale._src.registry import register_kind


class LossScale(metaclass=abc.ABCMeta):
    """Base class of loss-scale states; subclass it to define a kind of your own.

    A loss-scale state is an immutable pytree: its array fields have fixed dtypes
    and shapes (so a jitted step compiles once) and are packed into one leaf per
    dtype (two arrays for a dynamic scale), and its settings are static (kept by
    `jax.jit`, `jax.tree.map`, pickling and checkpoints). A kind
    is a subclass that declares

    * its array fields with `lossscale.field(dtype)` and its settings with
      `lossscale.setting()`, in the class body;
    * an `__init__` that validates its arguments and passes every field's initial
      value and every setting to `super().__init__(**values)`;
    * `scale`: the current loss scale, a float32 scalar (a field or a property);
    * `adjust(grads_finite)`: the rule, returning the state after a step whose
      loss was finite (`self.replace(...)`), branch-free so that it runs under
      `jax.jit`;
    * optionally `lowest_scale` and `highest_scale`: static bounds of the scale
      (Python floats; defaults 0.0 and inf, "unknown"). `lowest_scale` makes
      `stuck` meaningful and lets the finiteness check read the scaled gradients
      as they are when the scale stays >= 1; where both bounds are 1 the scale is
      a no-op.

    The library keeps every state's counters itself, through `lossscale.update`:

    * `skipped_steps` (int32): steps skipped for non-finite values (saturates at
      2**31 - 1);
    * `consecutive_skips` (int32): such steps in a row, up to the latest one;
    * `forward_overflows` (int32): skipped steps whose loss was not finite (an
      overflow in the forward pass, which no loss scale fixes; the rule does not
      see those steps: `adjust` runs, but its result is dropped);
    * `stuck` (bool): the latest step overflowed in the backward pass with the
      scale at `lowest_scale`, so backing off could not help.

    States compare by value (`==` on concrete arrays), and
    `get_config`/`from_config` round-trip the kind and its settings as JSON, as
    TF's `LossScale` does. `NoOpLossScale`, `StaticLossScale` and
    `DynamicLossScale` are defined the same way.

    Examples:
      TF contrib's test manager: the scale goes up by one after a finite step and
      down by one after a non-finite one.

      >>> import jax.numpy as jnp
      >>> import lossscale
      >>> class AddOneLossScale(lossscale.LossScale):
      ...     scale = lossscale.field(jnp.float32)
      ...     def __init__(self, initial_scale=8.0):
      ...         super().__init__(scale=initial_scale)
      ...     def adjust(self, grads_finite):
      ...         return self.replace(scale=self.scale + jnp.where(grads_finite, 1, -1))
      >>> state = AddOneLossScale()
      >>> for finite in [False, False, True]:
      ...     state = lossscale.update(state, jnp.array(finite))
      >>> print(state.scale, state.skipped_steps)
      7.0 2
      >>> print(AddOneLossScale.from_config(state.get_config()) == AddOneLossScale())
      True
    """

    __slots__ = ("_arrays", "_settings")

    kind: ClassVar[str]
    _fields: ClassVar[tuple[field, ...]]
    _layout: ClassVar[Layout]
    _setting_decls: ClassVar[tuple[setting, ...]]

    # The counters every state has; the library updates them (`lossscale.update`).
    skipped_steps = field(jnp.int32)
    consecutive_skips = field(jnp.int32)
    forward_overflows = field(jnp.int32)
    stuck = field(jnp.bool_)

    def __init_subclass__(cls, *, kind: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._fields, cls._setting_decls = declarations(cls, LossScale)
        cls._layout = Layout.of(cls._fields)
        cls.kind = register_kind(cls, kind)
        # Unflattening must not run `__init__`: leaves may be tracers, shape
        # structs or other placeholders.
        jax.tree_util.register_pytree_with_keys(
            cls, cls._flatten_with_keys, cls._unflatten, cls._flatten
        )

    def __init__(self, **values: Any):
        cls = type(self)
        own = rule_fields(cls)
        expected = {f.name for f in own} | {s.name for s in cls._setting_decls}
        if set(values) != expected:
            raise TypeError(
                f"`{cls.__name__}.__init__` must pass each of its fields and settings"
                f" to `LossScale.__init__` once: expected {sorted(expected)}, got"
                f" {sorted(values)}."
            )
        arrays = {f.name: jnp.zeros(f.shape, f.dtype) for f in COUNTER_FIELDS}
        for f in own:
            arrays[f.name] = f.as_array(values[f.name], cls.__name__, strict=False)
        settings = [s.checked(values[s.name], cls.__name__) for s in cls._setting_decls]
        object.__setattr__(self, "_arrays", cls._layout.pack(cls._fields, arrays))
        object.__setattr__(self, "_settings", tuple(settings))

    # -- what a kind defines -----------------------------------------------------

    @property
    @abc.abstractmethod
    def scale(self) -> jax.Array:
        """The current loss scale, a float32 scalar array."""

    @abc.abstractmethod
    def adjust(self, grads_finite: jax.Array) -> LossScale:
        """The kind's rule: this state after a step whose loss was finite.

        Called by `lossscale.update`, which also counts the skipped steps; call
        that, not this. It must be branch-free (it runs under `jax.jit`) and
        return a state of the same kind and settings, e.g. `self.replace(...)`.

        Args:
          grads_finite: bool scalar array, whether every gradient was finite (the
            step was applied) or not (it was skipped).
        """

    @property
    def lowest_scale(self) -> float:
        """The smallest scale this state can ever have: a static Python float.

        0.0 (the default) means unknown: `stuck` is then set only once the scale
        is no longer positive, and the finiteness check reads unscaled values in
        case the scale falls below 1.
        """
        return 0.0

    @property
    def highest_scale(self) -> float:
        """The largest scale this state can ever have: a static Python float.

        inf (the default) means unknown. Where both bounds are 1 (a no-op scale),
        losses and gradients pass through untouched.
        """
        return float("inf")

    # -- building and reading states ---------------------------------------------

    def replace(self, **values: Any) -> LossScale:
        """Returns this state with new values for some array fields.

        Args:
          **values: new values by field name; each takes the field's dtype (a
            weakly typed Python number is cast) and shape.

        Returns:
          A state of the same kind and settings.

        Raises:
          TypeError: if a name is not an array field, or a value has another dtype.
          ValueError: if a value has another shape.

        Examples:
          >>> import jax.numpy as jnp
          >>> import lossscale
          >>> state = lossscale.DynamicLossScale().replace(scale=jnp.float32(8.0))
          >>> print(state.scale, state.growth_interval)
          8.0 2000
        """
        cls = type(self)
        by_name = {f.name: f for f in cls._fields}
        unknown = set(values) - set(by_name)
        if unknown:
            raise TypeError(
                f"`{cls.__name__}.replace` takes array fields {sorted(by_name)}, got"
                f" {sorted(unknown)}. Settings are static: build a new state to"
                " change them."
            )
        arrays = {
            name: by_name[name].as_array(value, f"{cls.__name__}.replace", strict=True)
            for name, value in values.items()
        }
        for f in cls._fields:
            if f.name not in arrays:
                arrays[f.name] = self._read(f)
        return cls._unflatten(self._settings, cls._layout.pack(cls._fields, arrays))

    def get_config(self) -> dict[str, Any]:
        """Returns the kind and settings as a JSON-serialisable dict (TF's name).

        The arrays (the scale and the counters) are not part of it: save them
        with the checkpoint, and this dict beside it (see
        `lossscale.check_config`).

        Returns:
          `{"kind": ..., **settings}`, with private settings under their public
          names.

        Examples:
          >>> import lossscale
          >>> print(lossscale.StaticLossScale(1024).get_config())
          {'kind': 'static', 'scale': 1024.0}
        """
        settings = {s.public_name: getattr(self, s.name) for s in self._setting_decls}
        return {"kind": self.kind, **settings}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LossScale:
        """Returns a fresh state of the kind and settings in `config`.

        `LossScale.from_config` builds any registered kind (a kind defined in
        your code is registered once its module is imported); a subclass's
        `from_config` builds that kind only. The settings are passed to the
        kind's constructor by name, so a kind names its `__init__` arguments
        after its settings.

        Args:
          config: a dict from `get_config`.

        Returns:
          A new state with those settings and the constructor's initial arrays (a
          dynamic scale starts at 2**15, within its bounds; a restore overwrites
          the arrays).

        Raises:
          ValueError: if `config` is not a dict from `get_config` of this kind.

        Examples:
          >>> import lossscale
          >>> state = lossscale.LossScale.from_config({"kind": "static", "scale": 8})
          >>> print(type(state).__name__, state.scale)
          StaticLossScale 8.0
        """
        return build(cls, config)

    # -- pytree, pickling, equality, repr ------------------------------------------

    def _read(self, declared: field) -> Any:
        return type(self)._layout.read(self._arrays, declared)

    def _flatten_with_keys(self):
        keys = (jax.tree_util.GetAttrKey(n) for n in self._layout.leaf_names())
        return tuple(zip(keys, self._arrays, strict=True)), self._settings

    def _flatten(self):
        return self._arrays, self._settings

    @classmethod
    def _unflatten(cls, settings, arrays):
        state = object.__new__(cls)
        object.__setattr__(state, "_arrays", tuple(arrays))
        object.__setattr__(state, "_settings", settings)
        return state

    def __reduce__(self):
        # Pickle and deepcopy through the pytree fields: the default protocol
        # would set slots with `setattr`, which immutability forbids.
        return type(self)._unflatten, (self._settings, self._arrays)

    def __setattr__(self, name, value):
        raise AttributeError(
            f"`{type(self).__name__}` is immutable; use `state.replace(...)` or"
            " `lossscale.update` to get another state."
        )

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, LossScale):
            return NotImplemented
        return (
            type(self) is type(other)
            and self._settings == other._settings
            and all(map(_same_value, self._arrays, other._arrays))
        )

    __hash__ = None  # equal states may hold different buffers

    def __repr__(self) -> str:
        fields = [
            f"{f.name}={_format_leaf(getattr(self, f.name))}"
            for f in (*rule_fields(type(self)), *COUNTER_FIELDS)
        ]
        settings = [
            f"{s.public_name}={getattr(self, s.name)!r}" for s in self._setting_decls
        ]
        return f"{type(self).__name__}({', '.join(fields + settings)})"


COUNTER_FIELDS = (
    LossScale.skipped_steps,
    LossScale.consecutive_skips,
    LossScale.forward_overflows,
    LossScale.stuck,
)


def rule_fields(cls: type[LossScale]) -> tuple[field, ...]:
    """The array fields a kind declares (its rule's), without the counters."""
    return cls._fields[len(COUNTER_FIELDS) :]


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer):
        raise TypeError(
            "Loss-scale states compare by value, which needs concrete arrays; inside"
            " `jax.jit` compare fields instead, e.g. `a.scale == b.scale`."
        )
    if not (hasattr(a, "dtype") and hasattr(b, "dtype")):
        return a is b or a == b
    return a.dtype == b.dtype and bool(np.array_equal(np.asarray(a), np.asarray(b)))


def _format_leaf(value: Any) -> str:
    try:
        return repr(np.asarray(value).tolist())
    except Exception:  # a tracer, a shape struct or another placeholder
        return repr(value)
