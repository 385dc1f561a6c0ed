"""What a loss-scale kind is checked for: its declaration, and each new state.

Each mistake is refused where it is made, with what to do instead, rather than
failing later deep inside JAX (`docs/design.md`, "States").
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from typing import Any

import jax.numpy as jnp

from lossscale._src import deprecation
from lossscale._src import fields

# Names a kind may not use for a field: the base class's own attributes.
RESERVED = frozenset({"kind", "rule", "replace", "get_config", "from_config"})


def check_body(cls: type) -> None:
    """Refuses what `dataclasses` would refuse unclearly, and 0.2's class bodies.

    0.2's rule `adjust` becomes `rule` with a `DeprecationWarning` (unambiguous:
    a kind that defines `adjust` and no `rule` means it as the rule; without the
    alias a subclass of a built-in kind would silently keep the built-in rule).
    """
    body = vars(cls)
    annotations = body.get("__annotations__", {})
    for name, value in body.items():
        if (
            isinstance(value, dataclasses.Field)
            and fields.METADATA_KEY in value.metadata
            and name not in annotations
        ):
            spec = value.metadata[fields.METADATA_KEY]
            kind = "float" if spec.static else "jax.Array"
            raise TypeError(
                f"`{cls.__name__}.{name}` is a `lossscale.field` without an"
                f" annotation; a kind is a dataclass: write `{name}: {kind} ="
                f" lossscale.field(...)`."
            )
    for old, new in (("lowest_scale", "min_scale"), ("highest_scale", "max_scale")):
        if old in body:
            # No alias: on a `DynamicLossScale` subclass `min_scale` is a setting.
            raise TypeError(
                f"`{cls.__name__}` defines `{old}`, lossscale 0.2's name of a bound;"
                f" 0.3 reads `{new}` (a setting, a property or a class attribute,"
                f" a static Python float): rename it (see {deprecation.MIGRATION})."
            )
    if "adjust" in body and "rule" not in body:
        deprecation.warn(
            f"`{cls.__name__}.adjust(self, grads_finite)` is"
            f" `{cls.__name__}.rule(self, grads_finite)`: rename it"
        )
        cls.rule = body["adjust"]


def check_class(cls: type, base: type) -> None:
    """Refuses, at class creation, what would otherwise fail deep inside JAX."""
    own = vars(cls).get("__annotations__", {})
    for name in base._leaves:  # the counters
        if name in own:
            raise TypeError(
                f"`{cls.__name__}` declares `{name}`, a counter every state has and"
                " `lossscale.update` keeps; choose another name."
            )
    for f in dataclasses.fields(cls):
        if fields.METADATA_KEY not in f.metadata:
            raise TypeError(
                f"`{cls.__name__}.{f.name}` is a dataclass field without"
                " `lossscale.field`: declare an array leaf with"
                " `lossscale.field(dtype=..., default=...)` or a setting with"
                " `lossscale.field(static=True, default=...)`."
            )
        if f.name in RESERVED:
            raise TypeError(
                f"`{cls.__name__}` declares a field `{f.name}`, a name `LossScale`"
                " uses; choose another name."
            )
    spec = fields.specs(cls).get("scale")
    if spec is not None and (spec.dtype != jnp.float32 or spec.shape != ()):
        raise TypeError(
            f"`{cls.__name__}.scale` must be a float32 scalar array, got a field of"
            f" {spec.dtype} and shape {spec.shape}; the loss is multiplied by it."
        )
    if cls.rule is base.rule:
        raise TypeError(f"`{cls.__name__}` must define `rule(self, grads_finite)`.")
    if not hasattr(cls, "scale") and "scale" not in {
        f.name for f in dataclasses.fields(cls)
    }:
        raise TypeError(
            f"`{cls.__name__}` must define `scale`: an array field"
            " (`scale: jax.Array = lossscale.field(dtype=jnp.float32, ...)`) or a"
            " property returning a float32 scalar array."
        )


def finishing(init):
    """Wraps a kind's dataclass `__init__`: cast the arrays, check the result."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):  # noqa: N807
        cls = type(self)
        unknown = set(kwargs) - set(cls._specs)
        if unknown:
            raise TypeError(_unknown_argument(cls, min(unknown)))
        if args:
            _check_positional(cls, args)
        init(self, *args, **kwargs)
        finish(self)

    return __init__


def _check_positional(cls: type, args: tuple) -> None:
    positional = [f.name for f in dataclasses.fields(cls) if not f.kw_only]
    if len(args) > len(positional):
        takes = ", ".join(f"`{n}`" for n in positional) or "no argument"
        raise TypeError(
            f"`{cls.__name__}` takes {takes} by position, got {len(args)}"
            f" positional values; pass fields by keyword: {list(cls._specs)}."
        )


def _unknown_argument(cls: type, name: str) -> str:
    known = list(cls._specs)
    if isinstance(getattr(cls, name, None), property):
        why = f"`{name}` is a property `{cls.__name__}` computes, not an argument"
    else:
        close = difflib.get_close_matches(name, known, n=1)
        why = f"no field `{name}`" + (f" (did you mean `{close[0]}`?)" if close else "")
    return f"`{cls.__name__}` got an unexpected argument: {why}. It takes {known}."


def finish(state: Any) -> None:
    """Casts a new state's fields and checks its `scale` and bounds."""
    cls = type(state)
    name = cls.__name__
    for key, spec in cls._specs.items():
        value = state.__dict__[key]
        if spec.static:
            value = fields.checked_setting(value, name, key)
        elif value is None:
            raise TypeError(
                f"`{name}`: array field `{key}` has no value; pass `{key}=...` or give"
                " it a default."
            )
        else:
            value = fields.as_array(spec, value, name, key)
        object.__setattr__(state, key, value)
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
