"""`LossScale`, the base class of every kind, and the hooks run for every kind."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING
from typing import Any
from typing import ClassVar
from typing import Self
from typing import TypeVar
from typing import dataclass_transform

import jax
import jax.numpy as jnp
import numpy as np

from lossscale._src import deprecation
from lossscale._src.state import kind_fields
from lossscale._src.state import kind_validation
from lossscale._src.state import registry
from lossscale._src.state.kind_fields import field

if TYPE_CHECKING:

    class _Scale:
        """To type checkers, a state's `scale`: a float32 scalar array."""

        def __get__(self, state: object, kind: type | None = None) -> jax.Array: ...


# To type checkers, a kind is the dataclass it is at run time: its constructor takes
# its fields (`lossscale.field`), by keyword unless `kw_only=False`, and its
# instances are frozen.
@dataclass_transform(
    eq_default=False,
    kw_only_default=True,
    frozen_default=True,
    field_specifiers=(field,),
)
@dataclasses.dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class LossScale:
    """Base class of loss-scale states; subclass it to define a kind of your own.

    A state is a frozen, keyword-only dataclass and a pytree whose leaves are its
    array fields (`lossscale.field`). A kind subclasses `LossScale` and defines

    * its fields, each with a default if `from_config` is to build it;
    * `scale`: the current loss scale, a float32 scalar (a field or a property);
    * `rule(grads_finite)`: the rule, returning `self.replace(...)`, without
      Python branches on arrays (it runs under `jax.jit`);
    * optionally `min_scale` and `max_scale`, static Python floats (defaults
      0.0 and inf, "unknown"; where both are 1 the scale is a no-op);
    * optionally `__post_init__` to validate or derive settings (set them with
      `object.__setattr__`, as in any frozen dataclass).

    Every state also has the counters that `lossscale.update` keeps:
    `skipped_steps`, `consecutive_skips`, `forward_overflows` (int32), `stuck`
    (bool), `overflow_leaf` (int32, written by the guarded steps) and
    `overflow_scale` (float32: the scale the latest skipped step ran at, 0
    before any).

    Examples:
      The scale goes up by one after a finite step, down by one after another:

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
      .overflow_scale
    """

    kind = "abstract"  # the kind name, `get_config()["kind"]`

    skipped_steps: jax.Array = field(dtype=jnp.int32, default=0)
    consecutive_skips: jax.Array = field(dtype=jnp.int32, default=0)
    forward_overflows: jax.Array = field(dtype=jnp.int32, default=0)
    stuck: jax.Array = field(dtype=jnp.bool_, default=False)
    overflow_leaf: jax.Array = field(dtype=jnp.int32, default=-1)
    overflow_scale: jax.Array = field(dtype=jnp.float32, default=0.0)

    def __init__(self, **values: Any):  # a kind's is its dataclass `__init__`
        raise TypeError(
            "`LossScale` is the abstract base class of loss-scale kinds: build a kind"
            " (`DynamicLossScale()`, `StaticLossScale(s)`, `NoOpLossScale()`) or"
            " subclass it."
        )

    def __init_subclass__(cls, *, kind: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        kind_validation.declare(cls, COUNTERS, LossScale.rule)
        kind_fields.lay_out(cls, COUNTERS)
        cls.__init__ = kind_validation.validating(cls.__init__)  # type: ignore[method-assign]
        cls.kind = registry.register(cls, kind)
        for hook in _HOOKS:
            hook(cls)

    if TYPE_CHECKING:
        # Every kind has one, an array field or a property (checked where the class
        # is created). Declared by a descriptor: mypy and pyright then take either
        # in a kind (pyright refuses a field overriding a property).
        scale = _Scale()

    def rule(self, grads_finite: jax.Array) -> LossScale:
        """The kind's rule: this state after a step whose loss was finite.

        Called by `lossscale.update` (call that, not this) with `grads_finite`, a
        bool scalar array, under `jax.jit`; returns a state of the same kind,
        settings, dtypes and shapes, e.g. `self.replace(...)`.
        """
        raise NotImplementedError(f"`{type(self).__name__}` must define `rule`.")

    # The bounds of the scale: static Python floats, 0 and inf ("unknown") unless
    # a kind says (a setting, a property or a class attribute of that name).
    min_scale = 0.0
    max_scale = float("inf")
    # Set on each kind by `kind_fields.lay_out`.
    _specs: ClassVar[dict[str, kind_fields.FieldSpec]]
    _leaves: ClassVar[tuple[str, ...]]
    _settings: ClassVar[tuple[str, ...]]
    _positional: ClassVar[tuple[str, ...]]

    def replace(self, **values: Any) -> Self:
        """Returns this state with new values for some array fields.

        Args:
          **values: new values by field name, each of the field's dtype (a weakly
            typed Python number is cast) and of the current value's shape.

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
        kind, owner = type(self), f"{type(self).__name__}.replace"
        if unknown := set(values) - set(kind._leaves):
            raise TypeError(
                f"`{owner}` takes array fields {sorted(kind._leaves)}, got"
                f" {sorted(unknown)}. Settings are static: build a new state to change"
                " them."
            )
        new = object.__new__(kind)
        new.__dict__.update(self.__dict__)
        for name, value in values.items():
            spec, old = kind._specs[name], self.__dict__[name]
            new.__dict__[name] = kind_fields.as_array(spec, value, owner, name, old)
        return new

    def get_config(self) -> dict[str, Any]:
        """Returns the kind name and settings as a JSON-serialisable dict.

        The arrays are not part of it: save them with the checkpoint, and this
        dict beside it (see `lossscale.checkpoints.check_config`).

        Examples:
          >>> import lossscale
          >>> print(lossscale.StaticLossScale(1024).get_config())
          {'kind': 'static', 'value': 1024.0}
        """
        settings = type(self)._settings
        return {"kind": self.kind, **{n: getattr(self, n) for n in settings}}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
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
        config = kind_validation.validated_config(config, registry.known_kinds())
        config = deprecation.upgraded_config(config, quietly=False)
        name = config["kind"]
        if name not in registry.KINDS:
            raise ValueError(
                f"`config['kind']` must be one of {registry.known_kinds()}, got"
                f" {name!r}. (A"
                " kind defined in your code is known once its module is imported.)"
            )
        target = registry.KINDS[name]
        if target is None:
            raise ValueError(
                f"The kind {name!r} was defined inside a function, where every call"
                " makes another class of the same name, so the name does not say"
                " which to build. Name it: `class ...(lossscale.LossScale,"
                " kind='my_kind')`."
            )
        if not issubclass(target, cls):
            raise ValueError(
                f"`{cls.__name__}.from_config` got a config of kind {name!r}"
                f" ({target.__name__}); use `lossscale.LossScale.from_config` to"
                " build any kind."
            )
        settings = {key: value for key, value in config.items() if key != "kind"}
        kind_validation.validate_settings(settings, target._settings, name)
        return target(**settings)

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, LossScale):
            return NotImplemented
        # Settings first: states with other settings differ, even when traced.
        names = type(self)._settings + type(self)._leaves
        return type(self) is type(other) and all(
            _same_value(getattr(self, n), getattr(other, n)) for n in names
        )

    __hash__ = None  # type: ignore[assignment]  # equal states may hold other buffers

    if not TYPE_CHECKING:  # to a type checker, a misspelt attribute is an error

        def __getattr__(self, name: str) -> Any:  # only for names no state has
            return deprecation.state_attribute(self, name)  # 0.2's `lowest_scale`

    def __repr__(self) -> str:
        kind = type(self)
        parts = [f"{n}={_format_leaf(getattr(self, n))}" for n in kind._leaves]
        parts += [f"{n}={getattr(self, n)!r}" for n in kind._settings]
        return f"{kind.__name__}({', '.join(parts)})"


kind_fields.lay_out(LossScale, ())
# A state of some kind: what `update` and `apply_gradients` return is of the kind
# they were given.
LossScaleT = TypeVar("LossScaleT", bound=LossScale)
# The counters every state has, which `lossscale.update` keeps.
COUNTERS = LossScale._leaves
# The counters a lossscale 0.3.0 checkpoint lacks (`compat` restores it).
ADDED_AFTER_0_3_0 = ("overflow_scale",)


def rule_fields(kind: type[LossScale]) -> tuple[str, ...]:
    """The array fields a kind declares (its rule's), without the counters."""
    return tuple(n for n in kind._leaves if n not in COUNTERS)


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


# What to call for every kind (`lossscale.flax` registers each with
# `flax.serialization`, without this module importing Flax).
_HOOKS: list[Any] = []


def for_every_kind(hook) -> None:
    """Calls `hook(kind)` for every kind defined so far and every later one."""
    _HOOKS.append(hook)
    pending = LossScale.__subclasses__()
    while pending:
        kind = pending.pop(0)
        if "kind" in vars(kind):  # registered: defined to the end
            hook(kind)
        pending += kind.__subclasses__()
