"""Finding the loss-scale state inside a tree: an optimizer state, a train state."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import optax

from lossscale._src import validation
from lossscale._src.state.kind import LossScale
from lossscale._src.step import fp8
from lossscale._src.step import unscaling


def get_loss_scale(opt_state: Any) -> LossScale:
    """Returns the loss-scale state held anywhere inside an optimizer state.

    It looks through any pytree: the state of `lossscale.wrap` (an
    `optax.MultiSteps` inside it too), chains, `optax.inject_hyperparams` or other
    containers around it, a `lossscale.flax.TrainState` or
    `lossscale.flax.Optimizer`. Every function
    that takes "a state or a tree holding one" finds it this way.

    Args:
      opt_state: an optimizer state (any pytree), or a loss-scale state itself.

    Returns:
      The one loss-scale state found.

    Raises:
      TypeError: if `opt_state` is a spec (a number, "dynamic" or None): it
        describes a state to create, not the one the optimizer carries; or if
        it is the optimizer (the transformation) instead of its state.
      ValueError: if there is no state inside, or more than one (nested wraps).

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import lossscale
      >>> tx = optax.chain(optax.clip(1.0), lossscale.wrap(optax.sgd(0.1)))
      >>> opt_state = tx.init(jnp.zeros(3))
      >>> print(lossscale.get_loss_scale(opt_state).scale)
      32768.0
    """
    return find(opt_state, "opt_state")


def find(value: Any, name: str) -> LossScale:
    """`get_loss_scale(value)`, naming the argument `name` in its errors.

    Warns when a dynamic state is a constant of a function being traced (see
    `_warn_if_closed_over`).
    """
    if isinstance(value, LossScale):  # the common case, without a tree walk
        _warn_if_closed_over(value, name)
        return value
    if isinstance(value, optax.GradientTransformation):
        raise TypeError(
            f"`{name}` is an optax transformation (the optimizer), not its state."
            " Pass the state the step carries: what `tx.init(params)` returned,"
            " as updated by `tx.update`."
        )
    # A per-step function that created a state from a spec would work from a
    # fresh one, not the optimizer's: after a back-off, a fresh dynamic scale is
    # 2**15 while the optimizer unscales by 2**14, a silently wrong step.
    if (
        value is None
        or isinstance(value, str)
        or validation.is_number(value)
        or jax.tree_util.treedef_is_leaf(jax.tree.structure(value))
    ):
        raise TypeError(
            f"`{name}` must be a loss-scale state or a tree holding one (the"
            " optimizer state of `lossscale.wrap`, a `lossscale.flax.TrainState`,"
            f" ...), got {value!r}. A number, 'dynamic' or None describes a"
            " loss scale to create (pass it to `lossscale.wrap` or"
            " `TrainState.create`); a per-step function must read the state that"
            " the optimizer carries, or it would miss the dynamic scale's"
            " back-offs. Pass that state, or for a fixed scale"
            " `lossscale.StaticLossScale(...)`."
        )
    state = _the_one(find_all(value), value, name)
    _warn_if_closed_over(state, name)
    return state


def _warn_if_closed_over(state: LossScale, name: str) -> None:
    """Warns if `state` is dynamic and a constant of a function being traced.

    Passed to `jax.jit` as an argument, its leaves are tracers while the function
    is traced. A concrete leaf there was closed over: the compiled function keeps
    the value it had then, and every later call scales by that stale scale. (Eager
    code, `jax.grad` outside `jit` included, reads the current value and is not
    warned about.)
    """
    if unscaling.always_one(state) or state.min_scale == state.max_scale:
        return  # a fixed scale: a constant by design
    scale = variable_value(state.scale)
    if not isinstance(scale, jax.Array) or isinstance(scale, jax.core.Tracer):
        return
    # Inside a traced function any new array is a tracer; eagerly it is concrete.
    if not isinstance(jnp.zeros((), jnp.int8), jax.core.Tracer):
        return
    warnings.warn(
        f"`{name}` holds a dynamic loss-scale state that is a constant of the"
        " function being traced: the function closes over it instead of taking it"
        " as an argument. Compiled (`jax.jit`, `nnx.jit`), the function keeps the"
        f" scale it had then ({float(scale)}), and once the optimizer's scale grows"
        " or backs off the loss is still multiplied by that one. Pass the state,"
        " or the optimizer state or train state holding it, as an argument of the"
        " jitted function.",
        stacklevel=4,
    )


def variable_value(x: Any) -> Any:
    """`x`'s value if it is a Flax `nnx.Variable` (Flax 0.11 and 0.12), else `x`."""
    if hasattr(x, "get_value"):  # Flax 0.12
        return x.get_value()
    if hasattr(x, "raw_value"):  # Flax 0.11
        return x.value
    return x


def scale_to_evaluate_at(value: Any, name: str, owner: str) -> Any:
    """A number `value` as is, else the state in it: for functions asking "what if".

    `grad_stats` and `locate_overflow` evaluate at a scale, so a number is a
    question there, not a state to create; a string or None is neither.
    """
    if validation.is_number(value):
        return value
    if value is None or isinstance(value, str):
        raise TypeError(
            f"`{name}` of `{owner}` is the scale to evaluate at: a positive number"
            " (e.g. `2.0**15`), or a loss-scale state or a tree holding one (the"
            f" optimizer state, for its current scale); got {value!r}, which"
            " describes a loss scale to create, not a scale."
        )
    return find(value, name)


def find_all(tree: Any) -> list[tuple[Any, LossScale]]:
    """The (key path, state) pairs of every loss-scale state inside `tree`."""
    found = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(
        tree, is_leaf=lambda node: isinstance(node, LossScale | optax.MultiStepsState)
    ):
        if isinstance(leaf, optax.MultiStepsState):
            inner = find_all(leaf.inner_opt_state)
            if inner:
                fp8.refuse_accumulated_outside(leaf)
            where = (*path, jax.tree_util.GetAttrKey("inner_opt_state"))
            found += [((*where, *inner_path), state) for inner_path, state in inner]
        elif isinstance(leaf, LossScale):
            found.append((path, leaf))
    return found


def refuse_wrapped(opt_state: Any, name: str, owner: str) -> None:
    """Raises `ValueError` if `opt_state` (of the argument `name`) holds a state."""
    if found := find_all(opt_state):
        where = jax.tree_util.keystr(found[0][0]) or "<root>"
        raise ValueError(
            f"`{name}` already holds a loss-scale state (at {where}): the optimizer"
            " is wrapped with `lossscale.wrap` already. Pass the unwrapped"
            f" optimizer: {owner} does the loss scaling itself, and an optimizer"
            " wrapped already would see its gradients unscaled twice."
        )


def refuse_in_params(params: Any, owner: str) -> None:
    """Raises `TypeError` if `params` (an argument of `owner`) holds a state."""
    if found := find_all(params):
        where = jax.tree_util.keystr(found[0][0]) or "<root>"
        raise TypeError(
            f"`params` of {owner} holds a loss-scale state (at {where}): `params`"
            " are the parameters to train, and a loss-scale state is not one. Pass"
            " the model's parameters; the loss-scale state goes in `loss_scale`"
            " (`apply_gradients`, `TrainState.create`), or in the optimizer state"
            " that `lossscale.wrap(tx).init(params)` returns."
        )


def _the_one(found: list[tuple[Any, LossScale]], tree: Any, name: str) -> LossScale:
    if not found:
        raise ValueError(
            f"No loss-scale state found in `{name}` (a {type(tree).__name__})."
            " Build the optimizer with `lossscale.wrap(inner, loss_scale=...)`, or"
            " pass the loss-scale state itself."
        )
    if len(found) > 1:
        paths = ", ".join(jax.tree_util.keystr(path) or "<root>" for path, _ in found)
        raise ValueError(
            f"`{name}` holds {len(found)} loss-scale states, at {paths}; which"
            " one is meant is ambiguous. Wrap the optimizer once, or pass the"
            " loss-scale state itself."
        )
    return found[0][1]
