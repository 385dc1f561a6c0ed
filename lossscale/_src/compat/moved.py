"""The names lossscale 0.4 moved off the top level: aliases that warn until 0.5.

Diagnostics went to `lossscale.diagnostics`, checkpoints to `lossscale.checkpoints`;
the four checkpoint functions with a version in their names became `layout` and
`upgrade`, which read every known version.
"""

from __future__ import annotations

import importlib
from typing import Any

from lossscale._src import deprecation

_NOTE = "moved in lossscale 0.4; the old name goes in 0.5, see CHANGELOG.md"

# Old top-level name -> (its module now, its name there).
MOVED = {
    **{
        name: ("lossscale.diagnostics", name)
        for name in (
            "Finding",
            "OverflowReport",
            "PreflightReport",
            "grad_stats",
            "leaf_path",
            "locate_overflow",
            "preflight",
            "preflight_step",
        )
    },
    "check_config": ("lossscale.checkpoints", "check_config"),
}

# The versioned checkpoint functions: what replaces each, and where it is now.
RETIRED = {
    "checkpoint_0_2_layout": (
        "lossscale._src.compat.checkpoints",
        "lossscale.checkpoints.layout(target, '0.2')",
    ),
    "from_checkpoint_0_2": (
        "lossscale._src.compat.checkpoints",
        "lossscale.checkpoints.upgrade(restored, target)",
    ),
    "checkpoint_0_3_0_layout": (
        "lossscale._src.compat.checkpoint_0_3_0",
        "lossscale.checkpoints.layout(target, '0.3.0')",
    ),
    "from_checkpoint_0_3_0": (
        "lossscale._src.compat.checkpoint_0_3_0",
        "lossscale.checkpoints.upgrade(restored, target)",
    ),
}


def module_attribute(name: str, warn: bool = True) -> Any:
    """`lossscale.<name>` for a name 0.4 moved, with a warning; else `KeyError`."""
    if name in MOVED:
        module, new = MOVED[name]
        message = f"`lossscale.{name}` is `{module}.{new}`"
    else:
        module, instead = RETIRED[name]
        new, message = name, f"`lossscale.{name}` is `{instead}`"
    if warn:
        deprecation.warn(message, note=_NOTE)
    return getattr(importlib.import_module(module), new)
