"""The registry of kind names: the kind `LossScale.from_config` builds for a name."""

from __future__ import annotations

# A kind defined in a function without `kind=` maps to None: every call makes
# another class of the same name, so the name does not say which to build.
KINDS: dict[str, type | None] = {}


def register(cls: type, kind: str | None) -> str:
    """Registers `cls` under `kind`, or its module and qualified name; the name."""
    where = (cls.__module__, cls.__qualname__)
    name = ".".join(where) if kind is None else kind
    if not isinstance(name, str) or not name:
        raise TypeError(f"`kind` must be a non-empty string, got {name!r}.")
    local = kind is None and "<locals>" in name
    known = None if local else KINDS.get(name)
    if known is not None and (known.__module__, known.__qualname__) != where:
        raise ValueError(
            f"The kind name {name!r} is taken by `{known.__module__}."
            f"{known.__qualname__}`; pass another one: `class {cls.__name__}("
            "lossscale.LossScale, kind=...)`."
        )
    # The same class defined again (a re-run notebook cell) replaces the old one.
    KINDS[name] = None if local else cls
    return name


def known_kinds() -> list[str]:
    """The kind names `from_config` can build."""
    return sorted(name for name, kind in KINDS.items() if kind is not None)
