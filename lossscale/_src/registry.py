"""Kind names: `LossScale.from_config` builds the kind a config names."""

from __future__ import annotations

import difflib
from typing import Any

from lossscale._src import deprecation

# Kind name -> class.
_KINDS: dict[str, type] = {}
# Names of kinds defined in a function without `kind=`: not buildable by name.
_LOCAL: set[str] = set()


def register_kind(cls: type, kind: str | None) -> str:
    """Registers `cls` under its kind name, for `LossScale.from_config`."""
    name = kind if kind is not None else f"{cls.__module__}.{cls.__qualname__}"
    if not isinstance(name, str) or not name:
        raise TypeError(f"`kind` must be a non-empty string, got {name!r}.")
    if kind is None and "<locals>" in name:
        # Classes made by one function share a name: none can own it.
        _LOCAL.add(name)
        return name
    known = _KINDS.get(name)
    if known is not None and (known.__module__, known.__qualname__) != (
        cls.__module__,
        cls.__qualname__,
    ):
        raise ValueError(
            f"The kind name {name!r} is taken by `{known.__module__}."
            f"{known.__qualname__}`; pass another one: `class {cls.__name__}("
            "lossscale.LossScale, kind=...)`."
        )
    # The same class defined again (a re-run notebook cell) replaces the old one.
    _KINDS[name] = cls
    return name


def kind_named(name: Any) -> type | None:
    """The class registered under the kind name `name`, or None."""
    return _KINDS.get(name) if isinstance(name, str) else None


def known_kinds() -> list[str]:
    """The registered kind names."""
    return sorted(_KINDS)


def build(cls: type, config: Any) -> Any:
    """`cls.from_config(config)`: a fresh state of the kind and settings in it."""
    config = upgraded(checked_config(config))
    name = config["kind"]
    target = kind_named(name)
    if target is None and name in _LOCAL:
        raise ValueError(
            f"The kind {name!r} was defined inside a function, where"
            " every call makes another class of the same name, so the name does"
            " not say which to build. Name it: `class ...(lossscale.LossScale,"
            " kind='my_kind')`."
        )
    if target is None:
        raise ValueError(
            f"`config['kind']` must be one of {known_kinds()}, got {name!r}. (A kind"
            " defined in your code is known once its module is imported.)"
        )
    if not issubclass(target, cls):
        raise ValueError(
            f"`{cls.__name__}.from_config` got a config of kind"
            f" {name!r} ({target.__name__}); use"
            " `lossscale.LossScale.from_config` to build any kind."
        )
    settings = {key: value for key, value in config.items() if key != "kind"}
    expected = set(target._settings)
    if set(settings) != expected:
        unknown = sorted(set(settings) - expected, key=str)
        hints = [
            f"{key!r} (did you mean {close[0]!r}?)"
            if (close := difflib.get_close_matches(str(key), expected, n=1))
            else repr(key)
            for key in unknown
        ]
        raise ValueError(
            f"`config` of kind {name!r} must have the settings {sorted(expected)},"
            f" got {sorted(settings, key=str)}: missing"
            f" {sorted(expected - set(settings))}, unknown [{', '.join(hints)}]."
            " Save `state.get_config()`, which writes every setting."
        )
    return target(**settings)


def checked_config(config: Any) -> dict[str, Any]:
    """`config` if it is a dict with a string under 'kind'; else says what it is."""
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
            f" {known_kinds()}), as `state.get_config()` writes; got keys"
            f" {sorted(config, key=str)}."
        )
    if not isinstance(config["kind"], str):
        raise ValueError(
            "`config['kind']` must be a kind's name, a string (one of"
            f" {known_kinds()}), got {config['kind']!r}"
            f" ({type(config['kind']).__name__})."
        )
    return config


def upgraded(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with 0.2's key of a static scale, `scale`, read as `value`."""
    if config["kind"] == "static" and "scale" in config and "value" not in config:
        deprecation.warn(
            "A static loss scale's config key 'scale' is 'value' since 0.3: save"
            " `state.get_config()` anew"
        )
        config = {**config, "value": config["scale"]}
        del config["scale"]
    return config
