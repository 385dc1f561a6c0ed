"""`value_and_grad` of the scaled loss, reporting the unscaled loss."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax

from lossscale._src import validation
from lossscale._src.api import functional
from lossscale._src.api import lookup


def value_and_grad(
    fun: Callable[..., Any],
    *,
    has_aux: bool = False,
    argnums: int | Sequence[int] = 0,
    axis_name: validation.AxisName | None = None,
) -> Callable[..., tuple[Any, Any]]:
    """Like `jax.value_and_grad`, but differentiates the loss times the loss scale.

    The returned function is called as `g(loss_scale, *args, **kwargs)`: first the
    loss-scale state (or a tree holding one, as for `lossscale.scale_loss`), then
    `fun`'s own arguments, which `argnums` counts. The gradients are those of
    `scale_loss(fun(...), loss_scale)`, for `wrap`'s `update` or
    `TrainState.apply_gradients` to unscale; the loss and `aux` are `fun`'s. With
    `axis_name` the gradients are averaged over that mapped axis.

    Args:
      fun: the loss function; returns a floating-point scalar, or a pair
        `(loss, aux)` when `has_aux` is True.
      has_aux: whether `fun` returns `(loss, aux)`.
      argnums: which of `fun`'s positional arguments to differentiate: an int or
        a sequence of ints.
      axis_name: None, or a mapped axis name (or tuple) to average over.

    Returns:
      A function `g(loss_scale, *args, **kwargs)` returning `(loss, grads)`, or
      `((loss, aux), grads)` with `has_aux`; for a tuple `argnums`, a tuple `grads`.

    Raises:
      TypeError: if `fun` is not callable, `has_aux` is not a bool, `argnums`
        is not an int or a sequence of ints, or `axis_name` is not a name; when
        called, if `fun`'s result does not match `has_aux`, or its loss is not
        a floating-point scalar.
      ValueError: if `argnums` is empty or negative; when called, if nothing
        around the call binds `axis_name`.

    Examples:
      >>> import jax, jax.numpy as jnp, lossscale
      >>> def loss_fn(w, x):
      ...     return jnp.sum(w * x), {"norm": jnp.linalg.norm(w)}
      >>> grad_fn = jax.jit(lossscale.value_and_grad(loss_fn, has_aux=True))
      >>> loss_scale = lossscale.StaticLossScale(1024)
      >>> (loss, aux), grads = grad_fn(loss_scale, jnp.ones(2), jnp.array([1.0, 2.0]))
      >>> print(loss, aux["norm"], grads)
      3.0 1.4142135 [1024. 2048.]
    """
    if not callable(fun):
        raise TypeError(f"`fun` must be callable, got {type(fun).__name__}.")
    if not isinstance(has_aux, bool):
        raise TypeError(f"`has_aux` must be a bool, got {has_aux!r}.")
    _validate_argnums(argnums)
    axis_name = validation.validate_axis_name(axis_name)

    def scaled_fun(state, *args, **kwargs):
        loss, aux = split_loss(fun(*args, **kwargs), has_aux, "fun", "fun(...)")
        return functional.scale_loss(loss, state), (loss, aux)

    def grad_fn(loss_scale, *args, **kwargs):
        try:
            state = lookup.find(loss_scale, "loss_scale")
        except (TypeError, ValueError) as error:
            raise type(error)(
                f"{error} (The function `value_and_grad(fun)` returns is called as"
                " `grad_fn(loss_scale, *args, **kwargs)`: the loss-scale state, or"
                " the optimizer state holding it, first, then `fun`'s arguments.)"
            ) from None
        validation.refuse_unbound_axis(axis_name, "value_and_grad")
        if max(_entries(argnums)) >= len(args):
            raise ValueError(
                f"`argnums` is {argnums!r} but `fun` was given {len(args)}"
                " positional argument(s) after the loss scale."
            )
        # Shift argnums past the loss-scale state, which is never differentiated.
        shifted = (
            argnums + 1
            if isinstance(argnums, numbers.Integral)
            else tuple(i + 1 for i in argnums)
        )
        (_, (loss, aux)), grads = jax.value_and_grad(
            scaled_fun, argnums=shifted, has_aux=True
        )(state, *args, **kwargs)
        if axis_name is not None:
            grads = jax.lax.pmean(grads, axis_name)
        return ((loss, aux), grads) if has_aux else (loss, grads)

    return grad_fn


def split_loss(out: Any, has_aux: bool, name: str, call: str) -> tuple[jax.Array, Any]:
    """`(loss, aux)` of `out`, what the function `name` returned as `call`.

    Raises `TypeError` saying how to set `has_aux` if `out` does not match it,
    and checks that the loss is a floating-point scalar.
    """
    pair = isinstance(out, tuple | list) and len(out) == 2
    if has_aux and not pair:
        raise TypeError(
            f"With `has_aux=True`, `{name}` must return a pair `(loss, aux)`; it"
            f" returned {_described(out)}. If it returns the loss alone, pass"
            " `has_aux=False` (the default)."
        )
    if not has_aux and isinstance(out, tuple | list):
        hint = " If it returns `(loss, aux)`, pass `has_aux=True`." if pair else ""
        raise TypeError(
            f"`{name}` must return a floating-point scalar, the loss; it returned"
            f" {_described(out)}.{hint}"
        )
    loss, aux = out if has_aux else (out, None)
    return validation.validate_loss(loss, f"{call}[0]" if has_aux else call), aux


def _described(out: Any) -> str:
    if isinstance(out, tuple | list):
        return f"a {type(out).__name__} of {len(out)}"
    shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
    if shape is None or dtype is None:
        return f"a {type(out).__name__}"
    kind = "scalar" if shape == () else f"array of shape {tuple(shape)}"
    return f"a {dtype} {kind}"


def _entries(argnums: Any) -> tuple[Any, ...] | None:
    if isinstance(argnums, numbers.Integral):
        return (argnums,)
    if isinstance(argnums, Sequence) and not isinstance(argnums, str):
        return tuple(argnums)
    return None


def _validate_argnums(argnums: Any) -> None:
    entries = _entries(argnums)
    if entries is None or not all(
        isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in entries
    ):
        raise TypeError(
            f"`argnums` must be an int or a sequence of ints, got {argnums!r}."
        )
    if not entries:
        raise ValueError("`argnums` must not be empty.")
    if any(i < 0 for i in entries):
        raise ValueError(
            f"`argnums` must be >= 0 (negative indices are ambiguous once the"
            f" loss-scale argument is prepended), got {argnums!r}."
        )
