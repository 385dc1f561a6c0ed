"""`LossScale`: the base class of every loss-scale kind, built-in or user-defined."""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale._src import deprecation
from lossscale._src import fields
from lossscale._src import kind_checks
from lossscale._src.fields import field
from lossscale._src.registry import build
from lossscale._src.registry import register_kind


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class LossScale:
    """Base class of loss-scale states; subclass it to define a kind of your own.

    A state is a frozen, keyword-only dataclass and a pytree: each array field
    (`lossscale.field(dtype=...)`) is a leaf named by its field, and each
    setting (`lossscale.field(static=True)`) is part of the tree structure,
    kept by `jax.jit`, `jax.tree.map`, pickling and checkpoints. A kind
    subclasses `LossScale` (which makes it a dataclass) and defines

    * its fields, each with a default if `from_config` is to build it;
    * `scale`: the current loss scale, a float32 scalar (a field or a property);
    * `rule(grads_finite)`: the rule, returning `self.replace(...)`, without
      Python branches on arrays (it runs under `jax.jit`);
    * optionally `min_scale` and `max_scale`, static Python floats
      (defaults 0.0 and inf, "unknown"): `stuck` and the finiteness check use
      them, and where both are 1 the scale is a no-op;
    * optionally `__post_init__` to check or derive settings (set them with
      `object.__setattr__`, as in any frozen dataclass).

    Every state has the counters the library keeps through `lossscale.update`:
    `skipped_steps`, `consecutive_skips`, `forward_overflows` (int32),
    `stuck` (bool) and `overflow_leaf` (int32, written by the guarded steps);
    see the design note (`docs/design.md`, "States").

    Examples:
      TF contrib's test manager: the scale goes up by one after a finite step and
      down by one after a non-finite one.

      >>> import jax, jax.numpy as jnp
      >>> import lossscale
      >>> class AddOne(lossscale.LossScale, kind="doctest.add_one"):
      ...     scale: jax.Array = lossscale.field(dtype=jnp.float32, default=8.0)
      ...     def rule(self, grads_finite):
      ...         return self.replace(scale=self.scale + jnp.where(grads_finite, 1, -1))
      >>> state = AddOne()
      >>> for finite in [False, False, True]:
      ...     state = lossscale.update(state, jnp.array(finite))
      >>> print(state.scale, state.skipped_steps)
      7.0 2
      >>> paths = jax.tree_util.tree_leaves_with_path(state)
      >>> print(" ".join(jax.tree_util.keystr(path) for path, _ in paths))
      .scale .skipped_steps .consecutive_skips .forward_overflows .stuck .overflow_leaf
    """

    kind = "abstract"

    skipped_steps: jax.Array = field(dtype=jnp.int32, default=0)
    consecutive_skips: jax.Array = field(dtype=jnp.int32, default=0)
    forward_overflows: jax.Array = field(dtype=jnp.int32, default=0)
    stuck: jax.Array = field(dtype=jnp.bool_, default=False)
    overflow_leaf: jax.Array = field(dtype=jnp.int32, default=-1)

    def __init_subclass__(cls, *, kind: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if "__init__" in vars(cls):
            raise TypeError(
                f"`{cls.__name__}` defines `__init__`; a kind is a dataclass whose"
                " constructor takes its fields: give them defaults, check or derive"
                " values in `__post_init__`, or add a classmethod constructor (0.2's"
                f" `super().__init__(**values)` is gone: {deprecation.MIGRATION})."
            )
        kind_checks.check_body(cls)
        dataclasses.dataclass(frozen=True, kw_only=True, eq=False, repr=False)(cls)
        kind_checks.check_class(cls, LossScale)
        cls._specs = fields.specs(cls)
        # The rule's leaves first: checkpoints and `repr` open with `.scale`.
        arrays = [n for n, s in cls._specs.items() if not s.static]
        cls._leaves = tuple(n for n in arrays if n not in COUNTERS) + COUNTERS
        cls._settings = tuple(n for n, s in cls._specs.items() if s.static)
        cls._get_leaves = staticmethod(_getter(cls._leaves))
        cls._get_settings = staticmethod(_getter(cls._settings))
        cls.__init__ = kind_checks.finishing(cls.__init__)
        cls.kind = register_kind(cls, kind)
        _KINDS.append(cls)
        for hook in _NEW_KIND_HOOKS:
            hook(cls)
        # Unflattening skips `__init__`: leaves may be tracers, shape structs,
        # shardings or other placeholders.
        jax.tree_util.register_pytree_with_keys(
            cls, _flatten_with_keys, functools.partial(_unflatten, cls), _flatten
        )

    # -- what a kind defines -----------------------------------------------------

    def rule(self, grads_finite: jax.Array) -> LossScale:
        """The kind's rule: this state after a step whose loss was finite.

        Called by `lossscale.update`, which also counts the skipped steps; call
        that, not this. It runs under `jax.jit` and must return a state of the
        same kind, settings, dtypes and shapes, e.g. `self.replace(...)`.

        Args:
          grads_finite: bool scalar array, whether every gradient was finite (the
            step was applied) or not (it was skipped).
        """
        raise NotImplementedError(f"`{type(self).__name__}` must define `rule`.")

    # The bounds of the scale: static Python floats, 0 and inf ("unknown") unless
    # a kind says (a setting, a property or a class attribute of that name).
    min_scale = 0.0
    max_scale = float("inf")

    # -- building and reading states ---------------------------------------------

    def replace(self, **values: Any) -> LossScale:
        """Returns this state with new values for some array fields.

        Args:
          **values: new values by field name, each of the field's dtype (a weakly
            typed Python number is cast) and of the current value's shape.

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
        owner = f"{cls.__name__}.replace"
        unknown = set(values) - set(cls._leaves)
        if unknown:
            raise TypeError(
                f"`{owner}` takes array fields {sorted(cls._leaves)}, got"
                f" {sorted(unknown)}. Settings are static: build a new state to"
                " change them."
            )
        new = object.__new__(cls)
        new.__dict__.update(self.__dict__)
        for name, value in values.items():
            old = self.__dict__[name]
            new.__dict__[name] = fields.as_array(
                cls._specs[name],
                value,
                owner,
                name,
                like=old if hasattr(old, "shape") else None,
            )
        return new

    def get_config(self) -> dict[str, Any]:
        """Returns the kind and settings as a JSON-serialisable dict (TF's name).

        The arrays are not part of it: save them with the checkpoint, and this
        dict beside it (see `lossscale.check_config`).

        Examples:
          >>> import lossscale
          >>> print(lossscale.StaticLossScale(1024).get_config())
          {'kind': 'static', 'value': 1024.0}
        """
        return {"kind": self.kind, **{n: getattr(self, n) for n in self._settings}}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LossScale:
        """Returns a fresh state of the kind and settings in `config`.

        `LossScale.from_config` builds any registered kind (one defined in your
        code once its module is imported); a subclass's builds that kind only.
        Array fields take their defaults: a restore overwrites them. A static
        scale's config from 0.2 (`"scale"`, now `"value"`) is read, with a warning.

        Raises:
          ValueError: if `config` is not a dict from `get_config` of this kind.

        Examples:
          >>> import lossscale
          >>> state = lossscale.LossScale.from_config({"kind": "static", "value": 8})
          >>> print(type(state).__name__, state.scale)
          StaticLossScale 8.0
        """
        return build(cls, config)

    # -- equality and repr -----------------------------------------------------------

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, LossScale):
            return NotImplemented
        a, b = _flatten(self), _flatten(other)
        return (
            type(self) is type(other)
            and a[1] == b[1]
            and all(map(_same_value, a[0], b[0]))
        )

    __hash__ = None  # equal states may hold different buffers

    def __getattr__(self, name: str) -> Any:  # only for names no state has
        return deprecation.state_attribute(self, name)  # 0.2's `lowest_scale`, ...

    def __repr__(self) -> str:
        cls = type(self)
        parts = [f"{n}={_format_leaf(getattr(self, n))}" for n in cls._leaves]
        parts += [f"{n}={getattr(self, n)!r}" for n in cls._settings]
        return f"{cls.__name__}({', '.join(parts)})"


def _abstract_init(self, **values):
    raise TypeError(
        "`LossScale` is the abstract base class of loss-scale kinds: build a kind"
        " (`DynamicLossScale()`, `StaticLossScale(s)`, `NoOpLossScale()`) or"
        " subclass it."
    )


LossScale.__init__ = _abstract_init
LossScale._specs = fields.specs(LossScale)
LossScale._leaves = tuple(LossScale._specs)
LossScale._settings = ()

COUNTERS = LossScale._leaves

# Every kind defined so far, and what to call for each new one (`lossscale.flax`
# registers them with `flax.serialization` without importing Flax here).
_KINDS: list[type[LossScale]] = []
_NEW_KIND_HOOKS: list[Any] = []


def for_every_kind(hook) -> None:
    """Calls `hook(cls)` for every kind defined so far and every later one."""
    _NEW_KIND_HOOKS.append(hook)
    for cls in _KINDS:
        hook(cls)


def rule_fields(cls: type[LossScale]) -> tuple[str, ...]:
    """The array fields a kind declares (its rule's), without the counters."""
    return tuple(n for n in cls._leaves if n not in COUNTERS)


def _getter(names: tuple[str, ...]):
    # `attrgetter` reads in C: flattening runs on every jitted call's dispatch.
    if not names:
        return lambda state: ()
    get = operator.attrgetter(*names)
    return (lambda state: (get(state),)) if len(names) == 1 else get


def _flatten(state: LossScale):
    cls = type(state)
    return cls._get_leaves(state), cls._get_settings(state)


def _flatten_with_keys(state: LossScale):
    cls = type(state)
    keys = map(jax.tree_util.GetAttrKey, cls._leaves)
    return tuple(zip(keys, cls._get_leaves(state), strict=True)), cls._get_settings(
        state
    )


def _unflatten(cls: type, settings: tuple, leaves) -> LossScale:
    state = object.__new__(cls)
    values = state.__dict__
    values.update(zip(cls._leaves, leaves, strict=True))
    values.update(zip(cls._settings, settings, strict=True))
    return state


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
