"""A loss-scale state in its holder: put in at a chosen scale, or read as arrays.

The diagnostics run a user's step or optimizer at scales of their choosing: they
put a state in place of the one a tree holds (`with_loss_scale`), and read one
as plain arrays (`values`), NNX's `nnx.Variable`s included.
"""

from __future__ import annotations

import sys
from typing import Any

import jax

from lossscale._src.api import lookup
from lossscale._src.state.kind import LossScale


def with_loss_scale(tree: Any, loss_scale: LossScale) -> Any:
    """`tree` with `loss_scale` in place of each loss-scale state it holds.

    In Flax NNX objects (a `lossscale.flax.Optimizer`) the state's fields are
    `nnx.Variable`s, which the optimizer's update writes in place: they are kept,
    holding the new values, so the state must keep its kind and settings.
    """

    def put(old: Any) -> Any:
        if not isinstance(old, LossScale):
            return old
        variable = variable_type()
        is_variable = lambda x: isinstance(x, variable)  # noqa: E731
        if variable is None or not any(
            map(is_variable, jax.tree.leaves(old, is_leaf=is_variable))
        ):
            return loss_scale
        if jax.tree.structure(old, is_leaf=is_variable) != jax.tree.structure(
            loss_scale
        ):
            raise ValueError(
                f"`state` holds a Flax NNX optimizer whose loss scale is a"
                f" `{type(old).__name__}` with {old.get_config()}: its step runs"
                " at other scales by setting its `scale` in place, which needs a"
                " `DynamicLossScale`. Build the optimizer with"
                " `lossscale.flax.Optimizer(..., loss_scale='dynamic')` for this"
                " check."
            )
        return jax.tree.map(
            lambda var, new: var.replace(new), old, loss_scale, is_leaf=is_variable
        )

    return jax.tree.map(put, tree, is_leaf=lambda x: isinstance(x, LossScale))


def variable_type() -> Any:
    """`flax.nnx.Variable` if Flax NNX is imported (a state can hold one), else None."""
    return getattr(sys.modules.get("flax.nnx"), "Variable", None)


def values(state: LossScale) -> LossScale:
    """`state` with plain arrays as leaves (NNX's hold `nnx.Variable`s)."""
    variable = variable_type()
    if variable is None:
        return state
    return jax.tree.map(
        lambda x: lookup.variable_value(x) if isinstance(x, variable) else x,
        state,
        is_leaf=lambda x: isinstance(x, variable),
    )
