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

from lossscale._src import deprecation
from lossscale._src import validation
from lossscale._src.state import kind_fields
from lossscale._src.state.kind_fields import METADATA_KEY

# Names a kind may not use for a field: the base class's own attributes.
RESERVED = frozenset({"kind", "rule", "replace", "get_config", "from_config"})
_INT32_MAX = int(np.iinfo(np.int32).max)
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # 2**-126, the smallest normal


# -- settings: the built-in kinds' ---------------------------------------------------


def positive_float32(name: str, value: Any, owner: str) -> float:
    """`value` as the float32 value a rule computes with; > 0, normal and finite there.

    Not subnormal: XLA:CPU flushes a subnormal float32 to zero in a jitted step, so a
    `min_scale` of 1e-44 would let the scale reach 0.
    """
    if not validation.is_number(value):
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
    if rounded < _FLOAT32_TINY:
        raise ValueError(
            f"`{owner}`: `{name}` must be a normal float32, at least 2**-126"
            f" ({_FLOAT32_TINY:.4g}), got {value!r}: XLA flushes a subnormal to zero"
            " in a jitted step."
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


def declare(cls: Any, counters: tuple[str, ...], base_rule: Any) -> None:
    """Makes a kind's class a frozen, keyword-only dataclass, or says what is wrong.

    Before `dataclasses` reads the body, refuses what it would refuse unclearly
    and 0.2's class bodies; 0.2's rule `adjust` becomes `rule`, with a warning
    (without the alias a subclass of a built-in kind would silently keep the
    built-in rule). After, refuses what would otherwise fail deep inside JAX.
    """
    body, name = vars(cls), cls.__name__
    if "__init__" in body:
        raise TypeError(
            f"`{name}` defines `__init__`; a kind is a dataclass whose constructor"
            " takes its fields: give them defaults, check or derive values in"
            " `__post_init__`, or add a classmethod constructor (0.2's"
            f" `super().__init__(**values)` is gone: {deprecation.MIGRATION})."
        )
    own = body.get("__annotations__", {})
    for key, value in body.items():
        if isinstance(value, dataclasses.Field) and key not in own:
            spec = value.metadata.get(METADATA_KEY)
            if spec is not None:
                kind = "float" if spec.dtype is None else "jax.Array"
                raise TypeError(
                    f"`{name}.{key}` is a `lossscale.field` without an annotation;"
                    f" a kind is a dataclass: write `{key}: {kind} ="
                    " lossscale.field(...)`."
                )
    for old, new in (("lowest_scale", "min_scale"), ("highest_scale", "max_scale")):
        if old in body:
            # No alias: on a `DynamicLossScale` subclass `min_scale` is a setting.
            raise TypeError(
                f"`{name}` defines `{old}`, lossscale 0.2's name of a bound; 0.3"
                f" reads `{new}` (a setting, a property or a class attribute, a"
                f" static Python float): rename it (see {deprecation.MIGRATION})."
            )
    if "adjust" in body and "rule" not in body:
        deprecation.warn(
            f"`{name}.adjust(self, grads_finite)` is `{name}.rule(self,"
            " grads_finite)`: rename it"
        )
        cls.rule = body["adjust"]
    dataclasses.dataclass(frozen=True, kw_only=True, eq=False, repr=False)(cls)
    for key in counters:
        if key in own:
            raise TypeError(
                f"`{name}` declares `{key}`, a counter every state has and"
                " `lossscale.update` keeps; choose another name."
            )
    fields = dataclasses.fields(cls)
    for f in fields:
        if METADATA_KEY not in f.metadata:
            raise TypeError(
                f"`{name}.{f.name}` is a dataclass field without `lossscale.field`:"
                " declare an array leaf with `lossscale.field(dtype=...,"
                " default=...)` or a setting with `lossscale.field(static=True,"
                " default=...)`."
            )
        if f.name in RESERVED:
            raise TypeError(
                f"`{name}` declares a field `{f.name}`, a name `LossScale` uses;"
                " choose another name."
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
            f"`{name}` must define `scale`: an array field (`scale: jax.Array ="
            " lossscale.field(dtype=jnp.float32, ...)`) or a property returning a"
            " float32 scalar array."
        )


# -- a state, where it is built ------------------------------------------------------


def validating(init: Any) -> Any:
    """A kind's dataclass `__init__`, which then casts and validates the new state."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):  # noqa: N807
        cls, name = type(self), type(self).__name__
        known = list(cls._specs)
        if unknown := set(kwargs) - set(known):
            key = min(unknown)
            if isinstance(getattr(cls, key, None), property):
                why = f"`{key}` is a property `{name}` computes, not an argument"
            else:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f" (did you mean `{close[0]}`?)" if close else ""
                why = f"no field `{key}`{hint}"
            raise TypeError(
                f"`{name}` got an unexpected argument: {why}. It takes {known}."
            )
        if len(args) > len(cls._positional):
            takes = ", ".join(f"`{n}`" for n in cls._positional) or "no argument"
            raise TypeError(
                f"`{name}` takes {takes} by position, got {len(args)} positional"
                f" values; pass fields by keyword: {known}."
            )
        init(self, *args, **kwargs)
        values = self.__dict__
        for key, spec in cls._specs.items():
            if spec.dtype is None:
                values[key] = kind_fields.validated_setting(values[key], name, key)
            elif values[key] is None:
                raise TypeError(
                    f"`{name}`: array field `{key}` has no value; pass `{key}=...`"
                    " or give it a default."
                )
            else:
                values[key] = kind_fields.as_array(spec, values[key], name, key, None)
        scale = self.scale
        if not (hasattr(scale, "dtype") and hasattr(scale, "shape")):
            raise TypeError(
                f"`{name}.scale` must be a float32 scalar array, got"
                f" {type(scale).__name__}; return `jnp.asarray(x, jnp.float32)`."
            )
        batch = jnp.shape(self.skipped_steps)  # leading dims of a stacked state
        if scale.dtype != jnp.float32 or scale.shape not in ((), batch):
            raise TypeError(
                f"`{name}.scale` must be a float32 scalar array, got {scale.dtype} of"
                f" shape {scale.shape}; the loss is multiplied by it."
            )
        for bound in ("min_scale", "max_scale"):
            value = getattr(self, bound)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(
                    f"`{name}.{bound}` must be a static Python float (it decides"
                    f" what is compiled), got {type(value).__name__}; derive it"
                    " from settings, not from array fields."
                )

    return __init__


# -- a config, where `from_config` reads it ----------------------------------------


def validated_config(config: Any, known: list[str]) -> dict[str, Any]:
    """`config` if it is a dict with a string under 'kind'; else says what it is.

    `known` are the kind names that can be built, for the messages.
    """
    if not isinstance(config, dict):
        hint = ""
        if hasattr(config, "get_config"):
            hint = " Pass `state.get_config()`, not the state."
        elif callable(config):
            hint = " Call it: `state.get_config()`."
        elif isinstance(config, str | bytes):
            hint = " Parse a saved JSON text first: `json.loads(text)`."
        raise ValueError(
            "`config` must be a dict from `state.get_config()`, got"
            f" {type(config).__name__}.{hint}"
        )
    if "kind" not in config:
        raise ValueError(
            f"`config` must have the key 'kind' (the kind's name, one of {known}), as"
            f" `state.get_config()` writes; got keys {sorted(config, key=str)}."
        )
    if not isinstance(config["kind"], str):
        raise ValueError(
            f"`config['kind']` must be a kind's name, a string (one of {known}), got"
            f" {config['kind']!r} ({type(config['kind']).__name__})."
        )
    return config


def validate_settings(settings: dict[str, Any], names: tuple, kind: str) -> None:
    """Raises unless a config of kind name `kind` has exactly the settings `names`."""
    expected = set(names)
    if set(settings) != expected:
        hints = [
            f"{key!r} (did you mean {close[0]!r}?)"
            if (close := difflib.get_close_matches(str(key), expected, n=1))
            else repr(key)
            for key in sorted(set(settings) - expected, key=str)
        ]
        raise ValueError(
            f"`config` of kind {kind!r} must have the settings {sorted(expected)},"
            f" got {sorted(settings, key=str)}: missing"
            f" {sorted(expected - set(settings))}, unknown [{', '.join(hints)}]."
            " Save `state.get_config()`, which writes every setting."
        )
