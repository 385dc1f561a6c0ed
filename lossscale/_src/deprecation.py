"""lossscale 0.2's spellings: the warning, and aliases that need no kind.

The aliases of the kinds' arguments, of a state's attributes and of a config's key.

Per name, `docs/migration/lossscale_0_2.md` says which: an alias where 0.2's call
means one thing in 0.3 (a `DeprecationWarning` naming the new spelling, pointed at
the caller's line), an error where an alias would be wrong (a 0.2 kind's class body
cannot run in 0.3: its fields need annotations, and its `__init__` is gone). The
module's names that 0.2 had are in `compat_0_2`.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from types import FrameType
from typing import Any

MIGRATION = "docs/migration/lossscale_0_2.md"
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def warn(
    message: str, note: str = f"lossscale 0.2's spelling; see {MIGRATION}"
) -> None:
    """A `DeprecationWarning` attributed to the first caller outside lossscale."""
    # Python 3.11 has no `skip_file_prefixes`: count the package's own frames.
    level = 2
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(
        _PACKAGE + os.sep
    ):
        level, frame = level + 1, frame.f_back
    warnings.warn(f"{message} ({note})", DeprecationWarning, stacklevel=level)


def accept_0_2_arguments(cls: type, renamed: dict[str, str], order: tuple):
    """Wraps `cls.__init__` to take 0.2's keywords and positions, with a warning.

    Unambiguous: 0.3 has no argument of those names, and takes fewer positions.
    """
    init = cls.__init__  # type: ignore[misc]  # the class's own constructor, wrapped

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):  # noqa: N807
        for old, new in renamed.items():
            if old in kwargs and new not in kwargs:
                warn(f"`{cls.__name__}({old}=...)` is `{cls.__name__}({new}=...)`")
                kwargs[new] = kwargs.pop(old)
        extra = order[1 : len(args)]
        if len(args) > 1 and len(args) <= len(order) and not set(extra) & set(kwargs):
            names = ", ".join(f"{name}=..." for name in extra)
            warn(f"`{cls.__name__}` takes its settings by keyword: pass {names}")
            kwargs.update(zip(extra, args[1:], strict=True))
            args = args[:1]
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[misc]  # replaced on the class itself


def upgraded_config(config: dict[str, Any], *, quietly: bool) -> dict[str, Any]:
    """`config` with 0.2's key of a static scale, `scale`, read as `value`.

    `quietly` where a config is read as 0.2's (`from_checkpoint_0_2`).
    """
    if config["kind"] == "static" and "scale" in config and "value" not in config:
        if not quietly:
            warn(
                "A static loss scale's config key 'scale' is 'value' since 0.3: save"
                " `state.get_config()` anew"
            )
        config = {**config, "value": config["scale"]}
        del config["scale"]
    return config


# A state's attributes by 0.2's names, and their 0.3 names.
_RENAMED_ATTRIBUTES = {"lowest_scale": "min_scale", "highest_scale": "max_scale"}


def state_attribute(state: Any, name: str) -> Any:
    """`state.<name>` for an attribute 0.2's states had under another name."""
    new = _RENAMED_ATTRIBUTES.get(name)
    if new is None:
        raise AttributeError(
            f"{type(state).__name__!r} object has no attribute {name!r}"
        )
    warn(f"`state.{name}` is `state.{new}`")
    return getattr(state, new)
