"""The per-step functions: scale the loss, unscale the gradients, check finiteness."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any
from typing import overload

import jax

from lossscale._src import validation
from lossscale._src.api import lookup
from lossscale._src.state.kind import LossScale
from lossscale._src.step import finite
from lossscale._src.step import fp8
from lossscale._src.step import unscaling


@overload
def scale_loss(loss: Callable[[], Any], loss_scale: Any) -> Callable[[], jax.Array]: ...
@overload
def scale_loss(loss: jax.typing.ArrayLike, loss_scale: Any) -> jax.Array: ...
def scale_loss(loss: Any, loss_scale: Any) -> Any:
    """Returns the loss multiplied by the current loss scale.

    Differentiate the result: the gradients come out multiplied by the scale, which
    keeps small float16 gradients from underflowing. A float16 or bfloat16 loss is
    promoted to float32 first, so the scaled loss itself cannot overflow (gradients
    flowing back into float16 computations still can; that is what the dynamic
    scale detects). As TF's `get_scaled_loss`, it also takes a function of no
    arguments that returns the loss, and then returns such a function.

    Args:
      loss: the loss, a floating-point scalar, or a callable of no arguments
        returning one.
      loss_scale: the loss-scale state, or a tree holding one (the optimizer
        state of `lossscale.wrap`, a `lossscale.flax.TrainState`, ...). A number,
        "dynamic" or None is refused: those create a state, and the step must
        use the state the optimizer carries.

    Returns:
      `loss * scale`, in float32 (or in the loss's dtype if wider); for a
      callable `loss`, a callable returning it.

    Raises:
      TypeError: if `loss` is not a floating-point array (or a callable of no
        arguments) or holds a loss-scale state (the arguments swapped), or
        `loss_scale` is a spec (a number, "dynamic" or None) or an optimizer.
      ValueError: if `loss` is not a scalar, or `loss_scale` holds no state (or
        several).

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale
      >>> loss_scale = lossscale.StaticLossScale(1024)
      >>> scaled = lossscale.scale_loss(jnp.float16(0.5), loss_scale)
      >>> print(scaled, scaled.dtype)
      512.0 float32
      >>> scaled_fn = lossscale.scale_loss(lambda: jnp.float32(2.0), loss_scale)
      >>> print(scaled_fn())
      2048.0
    """
    _refuse_swapped(loss, "loss", "scale_loss(loss, loss_scale)")
    state = lookup.find(loss_scale, "loss_scale")
    if callable(loss) and not hasattr(loss, "dtype"):
        _refuse_arguments(loss)
        return lambda: scale_loss(loss(), state)
    return scaled(loss, state)


def scaled(loss: Any, state: LossScale) -> jax.Array:
    """`scale_loss(loss, state)` for a state at hand: no lookup, so no warning.

    For lossscale's own tracing (`locate_overflow`), which closes over a state
    on purpose.
    """
    loss = validation.validate_loss(loss)
    loss = loss.astype(unscaling.wide_dtype(loss.dtype))
    if unscaling.always_one(state):
        return loss
    return loss * state.scale.astype(loss.dtype)


def unscale_grads(grads: Any, loss_scale: Any) -> Any:
    """Divides every gradient by the loss scale, keeping each leaf's dtype.

    Each leaf is multiplied by `1 / scale` (computed in float32, as TF does) in
    float32 or wider, and rounded once to the leaf's dtype. For a power-of-two
    scale (the dynamic scale's defaults keep it one) this is exactly the quotient.
    `None` leaves, and Flax's fp8 `_overwrite_with_gradient` collection (new
    values, not gradients), pass through. Keep parameters, and hence gradients,
    in float32: unscaling into a float16 leaf loses again what scaling kept from
    underflowing.

    Args:
      grads: a pytree of floating-point gradients of the scaled loss.
      loss_scale: the loss-scale state the loss was scaled with, or a tree
        holding it (see `scale_loss`).

    Returns:
      The gradients divided by the scale, same tree and dtypes.

    Raises:
      TypeError: if a gradient leaf is not floating point (or complex) or is a
        sparse array, `grads` holds a loss-scale state (the arguments swapped),
        or `loss_scale` is a spec (a number, "dynamic" or None) or an optimizer.
      ValueError: if `loss_scale` holds no state (or several).

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale
      >>> grads = {"w": jnp.array([1024.0, 2048.0]), "b": None}
      >>> print(lossscale.unscale_grads(grads, lossscale.StaticLossScale(1024))["w"])
      [1. 2.]
    """
    _refuse_swapped(grads, "grads", "unscale_grads(grads, loss_scale)")
    state = lookup.find(loss_scale, "loss_scale")
    grads, metadata = fp8.split_off(grads, "grads")
    validation.validate_gradients(grads)
    return fp8.merge(unscaling.unscale(grads, state), metadata)


def all_finite(tree: Any, axis_name: validation.AxisName | None = None) -> jax.Array:
    """Returns True when every element of every leaf of `tree` is finite.

    One reduction per leaf, reading each leaf once (in the form XLA fuses; see
    `docs/design.md`). Integer and boolean leaves are always finite; `None` leaves,
    and leaves that are not arrays (an Equinox model's functions), are ignored.

    Under `jax.jit` with sharded arrays the result is already global: the
    reductions are over whole arrays, and XLA adds the cross-device reduction.
    Inside `shard_map` or `pmap` each device sees only its own shards; pass the
    mapped axis as `axis_name` to get one answer, the same on every device.

    Args:
      tree: any pytree of arrays (dense: sparse arrays are refused).
      axis_name: a mapped axis name (or tuple of names) of `shard_map`/`pmap` to
        agree over: True only if every device's tree is finite.

    Returns:
      A boolean scalar array.

    Raises:
      TypeError: if `axis_name` is not a string or a tuple of strings, or a leaf
        is a sparse array.
      ValueError: if no `shard_map`, `pmap` or `vmap` around the call binds
        `axis_name`.

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import lossscale
      >>> print(lossscale.all_finite({"a": jnp.ones(3), "b": jnp.float16(2.0)}))
      True
      >>> print(lossscale.all_finite({"a": jnp.ones(3), "b": jnp.array(jnp.nan)}))
      False
      >>> x = jnp.array([[1.0], [jnp.inf]])  # one row per device of a pmap
      >>> print(jax.vmap(lambda r: lossscale.all_finite(r, axis_name="i"),
      ...                axis_name="i")(x))
      [False False]
    """
    axis_name = validation.validate_axis_name(axis_name)
    validation.refuse_unbound_axis(axis_name, "all_finite")
    validation.refuse_sparse(tree, "tree")
    return finite.agree(finite.all_finite_leaves(jax.tree.leaves(tree)), axis_name)


def _refuse_swapped(first: Any, name: str, call: str) -> None:
    """Raises `TypeError` if the first argument, `name`, holds a loss-scale state."""
    if found := lookup.find_all(first):
        where = jax.tree_util.keystr(found[0][0]) or "<root>"
        raise TypeError(
            f"`{name}` holds a loss-scale state (at {where}): the arguments are"
            f" `{call}`, the loss-scale state (or the optimizer state holding it)"
            " second. Swap them."
        )


def _refuse_arguments(loss_fn: Callable[[], Any]) -> None:
    try:
        inspect.signature(loss_fn).bind()
    except TypeError:
        raise TypeError(
            "`loss` must be a floating-point scalar or a function of no arguments"
            f" returning one (as TF's `get_scaled_loss`); {loss_fn!r} takes"
            " arguments. Scale its result instead: `scale_loss(loss_fn(x), ...)`,"
            " or use `lossscale.value_and_grad`."
        ) from None
    except ValueError:  # no signature to inspect (a builtin): let the call decide
        pass
