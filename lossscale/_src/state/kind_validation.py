"""What a kind refuses, where the mistake is made: a declaration, a state, a config.

Each says what to do instead, rather than failing deep inside JAX (design.md, "States").
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale._src import checks
from lossscale._src import deprecation
from lossscale._src.state import kind_fields
from lossscale._src.state.kind_fields import METADATA_KEY

# Names a kind may not use for a field: the base class's own attributes.
RESERVED = frozenset({"kind", "rule", "replace", "get_config", "from_config"})
_INT32_MAX = int(np.iinfo(np.int32).max)
_FLOAT32_MAX = float(np.finfo(np.float32).max)


# -- settings: the built-in kinds' ---------------------------------------------------


def positive_float32(name: str, value: Any, owner: str) -> float:
    """`value` as the float32 value a rule computes with; > 0 and finite there."""
    if not checks.is_number(value):
        raise TypeError(
            f"`{owner}`: `{name}` must be a real number, got {value!r}"
            f" ({type(value).__name__})."
        )
    try:
        number = float(value)
    except OverflowError:  # an int beyond any float: out of range, like inf
        number = float("inf")
    except jax.errors.ConcretizationTypeError:
        raise TypeError(
            f"`{owner}`: `{name}` must be a concrete number, got a traced value."
            " Settings are static: pass a Python number. (With"
            " `optax.inject_hyperparams`, list loss-scale settings in `static_args`.)"
        ) from None
    rounded = float(np.float32(number)) if abs(number) <= _FLOAT32_MAX else np.inf
    if not (np.isfinite(number) and np.isfinite(rounded) and rounded > 0):
        text = repr(value)
        if len(text) > 40:
            text = f"{text[:20]}...{text[-8:]} ({len(text)} chars)"
        raise ValueError(
            f"`{owner}`: `{name}` must be positive and finite in float32 (within"
            f" (0, {_FLOAT32_MAX:.4g}]), got {text}."
        )
    return rounded


def positive_int32(name: str, value: Any, owner: str) -> int:
    """`value` as a Python int in [1, 2**31 - 1]."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"`{owner}`: `{name}` must be an int, got {value!r}"
            f" ({type(value).__name__})."
        )
    if not 1 <= int(value) <= _INT32_MAX:
        raise ValueError(
            f"`{owner}`: `{name}` must be an int in [1, {_INT32_MAX}], got {value!r}."
        )
    return int(value)


# -- a declaration, where the class is created -------------------------------------


def validate_body(cls: type) -> None:
    """Refuses what `dataclasses` would refuse unclearly, and 0.2's class bodies.

    0.2's rule `adjust` becomes `rule`, with a warning: without the alias a
    subclass of a built-in kind would silently keep the built-in rule.
    """
    body, name = vars(cls), cls.__name__
    if "__init__" in body:
        raise TypeError(
            f"`{name}` defines `__init__`; a kind is a dataclass whose"
            " constructor takes its fields: give them defaults, check or derive"
            " values in `__post_init__`, or add a classmethod constructor (0.2's"
            f" `super().__init__(**values)` is gone: {deprecation.MIGRATION})."
        )
    annotations = body.get("__annotations__", {})
    for key, value in body.items():
        if isinstance(value, dataclasses.Field) and key not in annotations:
            spec = value.metadata.get(METADATA_KEY)
            if spec is not None:
                kind = "float" if spec.static else "jax.Array"
                raise TypeError(
                    f"`{name}.{key}` is a `lossscale.field` without an"
                    f" annotation; a kind is a dataclass: write `{key}: {kind} ="
                    f" lossscale.field(...)`."
                )
    for old, new in (("lowest_scale", "min_scale"), ("highest_scale", "max_scale")):
        if old in body:
            # No alias: on a `DynamicLossScale` subclass `min_scale` is a setting.
            raise TypeError(
                f"`{name}` defines `{old}`, lossscale 0.2's name of a bound;"
                f" 0.3 reads `{new}` (a setting, a property or a class attribute,"
                f" a static Python float): rename it (see {deprecation.MIGRATION})."
            )
    if "adjust" in body and "rule" not in body:
        deprecation.warn(
            f"`{name}.adjust(self, grads_finite)` is"
            f" `{name}.rule(self, grads_finite)`: rename it"
        )
        cls.rule = body["adjust"]


def validate_class(cls: type, counters: tuple[str, ...], base_rule: Any) -> None:
    """Refuses, at class creation, what would otherwise fail deep inside JAX."""
    name, fields = cls.__name__, dataclasses.fields(cls)
    own = vars(cls).get("__annotations__", {})
    for key in counters:
        if key in own:
            raise TypeError(
                f"`{name}` declares `{key}`, a counter every state has and"
                " `lossscale.update` keeps; choose another name."
            )
    for f in fields:
        if METADATA_KEY not in f.metadata:
            raise TypeError(
                f"`{name}.{f.name}` is a dataclass field without"
                " `lossscale.field`: declare an array leaf with"
                " `lossscale.field(dtype=..., default=...)` or a setting with"
                " `lossscale.field(static=True, default=...)`."
            )
        if f.name in RESERVED:
            raise TypeError(
                f"`{name}` declares a field `{f.name}`, a name `LossScale`"
                " uses; choose another name."
            )
    spec = next((f.metadata[METADATA_KEY] for f in fields if f.name == "scale"), None)
    if spec is not None and (spec.dtype != jnp.float32 or spec.shape != ()):
        raise TypeError(
            f"`{name}.scale` must be a float32 scalar array, got a field of"
            f" {spec.dtype} and shape {spec.shape}; the loss is multiplied by it."
        )
    if cls.rule is base_rule:
        raise TypeError(f"`{name}` must define `rule(self, grads_finite)`.")
    if spec is None and not hasattr(cls, "scale"):
        raise TypeError(
            f"`{name}` must define `scale`: an array field"
            " (`scale: jax.Array = lossscale.field(dtype=jnp.float32, ...)`) or a"
            " property returning a float32 scalar array."
        )


# -- a state, where it is built ------------------------------------------------------


def validating(init: Any) -> Any:
    """A kind's dataclass `__init__`, which then casts and validates the new state."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):  # noqa: N807
        cls = type(self)
        known = list(cls._specs)
        if unknown := set(kwargs) - set(known):
            raise TypeError(_unknown_argument(cls, min(unknown), known))
        if len(args) > len(cls._positional):
            takes = ", ".join(f"`{n}`" for n in cls._positional) or "no argument"
            raise TypeError(
                f"`{cls.__name__}` takes {takes} by position, got {len(args)}"
                f" positional values; pass fields by keyword: {known}."
            )
        init(self, *args, **kwargs)
        _finish(self)

    return __init__


def _unknown_argument(cls: type, name: str, known: list[str]) -> str:
    if isinstance(getattr(cls, name, None), property):
        why = f"`{name}` is a property `{cls.__name__}` computes, not an argument"
    else:
        close = difflib.get_close_matches(name, known, n=1)
        why = f"no field `{name}`" + (f" (did you mean `{close[0]}`?)" if close else "")
    return f"`{cls.__name__}` got an unexpected argument: {why}. It takes {known}."


def _finish(state: Any) -> None:
    """Casts a new state's fields and validates its `scale` and bounds."""
    values, name = state.__dict__, type(state).__name__
    for key, spec in type(state)._specs.items():
        if spec.static:
            values[key] = kind_fields.validated_setting(values[key], name, key)
        elif values[key] is None:
            raise TypeError(
                f"`{name}`: array field `{key}` has no value; pass `{key}=...` or give"
                " it a default."
            )
        else:
            values[key] = kind_fields.as_array(spec, values[key], name, key)
    scale = state.scale
    if not (hasattr(scale, "dtype") and hasattr(scale, "shape")):
        raise TypeError(
            f"`{name}.scale` must be a float32 scalar array, got"
            f" {type(scale).__name__}; return `jnp.asarray(x, jnp.float32)`."
        )
    batch = jnp.shape(state.skipped_steps)  # leading dims of a stacked state
    if scale.dtype != jnp.float32 or scale.shape not in ((), batch):
        raise TypeError(
            f"`{name}.scale` must be a float32 scalar array, got {scale.dtype}"
            f" of shape {scale.shape}; the loss is multiplied by it."
        )
    for bound in ("min_scale", "max_scale"):
        value = getattr(state, bound)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(
                f"`{name}.{bound}` must be a static Python float (it decides what"
                f" is compiled), got {type(value).__name__}; derive it from"
                " settings, not from array fields."
            )


# -- a config, where `from_config` reads it ----------------------------------------


def validated_config(config: Any, known: list[str]) -> dict[str, Any]:
    """`config` if it is a dict with a string under 'kind'; else says what it is.

    `known` are the kind names that can be built, for the messages.
    """
    hint = ""
    if hasattr(config, "get_config"):
        hint = " Pass `state.get_config()`, not the state."
    elif callable(config):
        hint = " Call it: `state.get_config()`."
    elif isinstance(config, str | bytes):
        hint = " Parse a saved JSON text first: `json.loads(text)`."
    if not isinstance(config, dict):
        raise ValueError(
            "`config` must be a dict from `state.get_config()`, got"
            f" {type(config).__name__}.{hint}"
        )
    if "kind" not in config:
        raise ValueError(
            "`config` must have the key 'kind' (the kind's name, one of"
            f" {known}), as `state.get_config()` writes; got keys"
            f" {sorted(config, key=str)}."
        )
    if not isinstance(config["kind"], str):
        raise ValueError(
            "`config['kind']` must be a kind's name, a string (one of"
            f" {known}), got {config['kind']!r}"
            f" ({type(config['kind']).__name__})."
        )
    return config


def validate_settings(settings: dict[str, Any], names: tuple, kind: str) -> None:
    """Raises unless a config of kind name `kind` has exactly the settings `names`."""
    expected = set(names)
    if set(settings) != expected:
        unknown = sorted(set(settings) - expected, key=str)
        hints = [
            f"{key!r} (did you mean {close[0]!r}?)"
            if (close := difflib.get_close_matches(str(key), expected, n=1))
            else repr(key)
            for key in unknown
        ]
        raise ValueError(
            f"`config` of kind {kind!r} must have the settings {sorted(expected)},"
            f" got {sorted(settings, key=str)}: missing"
            f" {sorted(expected - set(settings))}, unknown [{', '.join(hints)}]."
            " Save `state.get_config()`, which writes every setting."
        )
