"""`lossscale.<name>` for the names lossscale 0.2 had and 0.3 does not.

Above the kinds, which one of them returns; the warning itself is `deprecation`'s.
"""

from __future__ import annotations

from typing import Any

import optax

from lossscale._src import validation
from lossscale._src.deprecation import MIGRATION
from lossscale._src.deprecation import warn
from lossscale._src.state import spec


def select_tree(pred: Any, on_true: Any, on_false: Any) -> Any:
    """0.2's `lossscale.select_tree`: `optax.tree_utils.tree_where`, with a warning."""
    warn(
        "`lossscale.select_tree(pred, a, b)` is"
        " `optax.tree_utils.tree_where(pred, a, b)`"
    )
    return optax.tree_utils.tree_where(
        validation.as_predicate("pred", pred, "lossscale.all_finite(grads)"),
        on_true,
        on_false,
    )


def module_attribute(name: str) -> Any:
    """`lossscale.<name>` for a name 0.2 had and 0.3 does not."""
    if name == "select_tree":
        return select_tree
    if name == "LossScaleLike":
        warn(
            "`lossscale.LossScaleLike` is gone: annotate with `lossscale.LossScale"
            " | float | str | None`"
        )
        return spec.StateOrSpec
    if name == "setting":
        raise AttributeError(
            "`lossscale.setting()` is gone: declare a setting in a kind's class body"
            " as `name: float = lossscale.field(static=True, default=...)` (an"
            f" annotation and a default; see {MIGRATION})."
        )
    raise AttributeError(f"module 'lossscale' has no attribute {name!r}")
