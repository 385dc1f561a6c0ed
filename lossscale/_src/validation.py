"""Argument checks: each raises `TypeError`/`ValueError` naming the argument and fix.

They run eagerly, on static information (types, dtypes, shapes, tree structures),
never on traced values.
"""

from __future__ import annotations

import functools
import numbers
import sys
from collections.abc import Callable
from typing import Any
from typing import ParamSpec
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

AxisName = str | tuple[str, ...]
_Parameters = ParamSpec("_Parameters")
_Result = TypeVar("_Result")


def by_keyword(
    positional: int, example: str
) -> Callable[[Callable[_Parameters, _Result]], Callable[_Parameters, _Result]]:
    """A decorator: more than `positional` arguments by position raise a TypeError.

    For functions whose other arguments are keyword-only: the error shows
    `example`, the call that works, not Python's bare count. The decorated
    function keeps its signature, to type checkers too.
    """

    def decorate(
        fn: Callable[_Parameters, _Result],
    ) -> Callable[_Parameters, _Result]:
        @functools.wraps(fn)
        def call(*args: _Parameters.args, **kwargs: _Parameters.kwargs) -> _Result:
            if len(args) > positional:
                raise TypeError(
                    f"`{fn.__name__}` takes {positional} argument(s) by position and"
                    f" the rest by keyword; got {len(args)} by position. Call it as"
                    f" {example}."
                )
            return fn(*args, **kwargs)

        return call

    return decorate


def validate_axis_name(axis_name: Any) -> AxisName | None:
    """`axis_name` if it is None, a str or a non-empty tuple of str."""
    if axis_name is None or isinstance(axis_name, str):
        return axis_name
    if (
        isinstance(axis_name, tuple)
        and axis_name
        and all(isinstance(name, str) for name in axis_name)
    ):
        return axis_name
    raise TypeError(
        "`axis_name` must be None, a mapped axis name (a str) or a non-empty tuple"
        f" of them, got {axis_name!r}."
    )


def refuse_unbound_axis(axis_name: AxisName | None, owner: str) -> None:
    """Raises `ValueError` unless every axis of `axis_name` is bound where called.

    Asks exactly what the collective over it would need (the axis's size), so
    it never refuses a `pmap`, `shard_map` or `vmap(axis_name=...)` that binds it.
    """
    names = (axis_name,) if isinstance(axis_name, str) else axis_name or ()
    for name in names:
        try:
            jax.lax.axis_size(name)
        except NameError:
            raise ValueError(
                f"`axis_name` is {axis_name!r}, but no `jax.pmap`, `jax.shard_map`"
                f" or `jax.vmap(..., axis_name=...)` around this call to `{owner}`"
                f" binds the axis {name!r}. Call it inside the mapped function"
                f" (e.g. `jax.pmap(train_step, axis_name={name!r})`); under plain"
                " `jax.jit` with sharded arrays, drop `axis_name`: the results are"
                " already global there."
            ) from None


def validate_clip_norm(clip_norm: Any) -> float | None:
    """`clip_norm` as a float, or None; raises for anything but a positive number."""
    if clip_norm is None:
        return None
    if isinstance(clip_norm, bool) or not isinstance(clip_norm, int | float):
        raise TypeError(
            "`clip_norm` must be None or a positive number (the global norm to clip"
            f" the unscaled gradients to), got {type(clip_norm).__name__}."
        )
    if not 0 < clip_norm < float("inf"):
        raise ValueError(f"`clip_norm` must be positive and finite, got {clip_norm!r}.")
    return float(clip_norm)


def validate_transformation(tx: Any, name: str) -> None:
    """Raises `TypeError` unless `tx` is an optax transformation."""
    if isinstance(tx, optax.MultiSteps):
        raise TypeError(
            f"`{name}` is an `optax.MultiSteps`, which is not a transformation"
            f" itself: pass `{name}.gradient_transformation()`. (With Flax fp8"
            " variables, accumulate with `lossscale.wrap(optax.MultiSteps(...))`"
            " instead: `docs/guides/accumulation.md`.)"
        )
    if not isinstance(tx, optax.GradientTransformation):
        called = (
            f" `{getattr(tx, '__name__', 'it')}` is a factory: call it, e.g."
            " `optax.adam(1e-3)`."
            if callable(tx)
            else ""
        )
        raise TypeError(
            f"`{name}` must be an optax transformation (e.g. `optax.adam(1e-3)`),"
            f" got {type(tx).__name__}.{called}"
        )


def as_predicate(name: str, value: Any, example: str) -> jax.Array:
    """`value` as a boolean scalar array; raises unless it is one, citing `example`."""
    if isinstance(value, bool | np.bool_):
        return jnp.asarray(value, jnp.bool_)
    dtype = getattr(value, "dtype", None)
    shape = getattr(value, "shape", None)
    if dtype is None or shape is None:
        raise TypeError(
            f"`{name}` must be a boolean scalar (a bool or a `jnp.bool_` array), got"
            f" {type(value).__name__}; compute it as `{example}`."
        )
    if shape != ():
        raise ValueError(
            f"`{name}` must be a scalar, got shape {tuple(shape)}; reduce it first,"
            f" e.g. `{example}`."
        )
    if dtype != jnp.bool_:
        raise TypeError(
            f"`{name}` must be boolean, got dtype {dtype}; compute it as `{example}`."
        )
    return jnp.asarray(value)


def validate_loss(loss: Any, name: str = "loss") -> jax.Array:
    """`loss` as a floating-point scalar array; raises unless it is one."""
    dtype = getattr(loss, "dtype", None)
    if dtype is None:
        if isinstance(loss, float):
            return jnp.asarray(loss, jnp.float32)
        raise TypeError(
            f"`{name}` must be a floating-point scalar array, got"
            f" {type(loss).__name__}."
        )
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"`{name}` must be floating point, got dtype {dtype}. Gradients of an"
            " integer loss are zero; compute the loss in floating point."
        )
    if getattr(loss, "shape", ()) != ():
        raise ValueError(
            f"`{name}` must be a scalar, got shape {tuple(loss.shape)}. Reduce it"
            " first, e.g. with `jnp.mean`."
        )
    return jnp.asarray(loss)


def validate_gradients(grads: Any, params: Any = None, name: str = "grads") -> None:
    """Raises for sparse, non-float or mismatched gradient trees, naming the leaf."""
    refuse_sparse(grads, name)
    for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
            hint = (
                " (With Equinox, `eqx.filter_grad` gives `None` for leaves that"
                " are not floating-point arrays, and `eqx.filter(model,"
                " eqx.is_inexact_array)` the matching parameters.)"
                if dtype is None
                else ""
            )
            raise TypeError(
                f"Gradients must be floating-point arrays; the leaf at"
                f" {_where(path)} has dtype {dtype} ({type(leaf).__name__})."
                f" Differentiate with respect to floating-point parameters only.{hint}"
            )
    if params is not None:
        # None marks a masked-out leaf in optax: compare structures up to it.
        grads_def = jax.tree.structure(grads, is_leaf=_is_none)
        params_def = jax.tree.structure(params, is_leaf=_is_none)
        if grads_def != params_def:
            raise ValueError(
                "The gradients and `params` must have the same tree structure, got"
                f" {grads_def} and {params_def}."
            )


def refuse_sparse(tree: Any, name: str) -> None:
    """Raises `TypeError` if `tree` holds a `jax.experimental.sparse` array.

    Their duplicate indices are summed only when densified, so a check of the
    stored values misses an overflow of the sum (two float16 entries of 64000 at
    one index), and optax's transformations treat their integer indices as
    values (an SGD step moves them). Dense gradients are the supported input.
    """
    sparse = sys.modules.get("jax.experimental.sparse")
    if sparse is None:  # nobody imported it, so no leaf can be sparse
        return
    for path, leaf in jax.tree_util.tree_leaves_with_path(
        tree, is_leaf=lambda x: isinstance(x, sparse.JAXSparse)
    ):
        if isinstance(leaf, sparse.JAXSparse):
            raise TypeError(
                f"`{name}` holds a sparse `{type(leaf).__name__}` at {_where(path)};"
                " lossscale takes dense gradients. Duplicate indices are summed only"
                " when densified, so an overflow of their sum would go unseen, and"
                " optax's transformations update a sparse array's indices as if"
                " they were values. Pass `leaf.todense()`, or keep the parameter"
                " dense."
            )


def refuse_changed_types(new_state: Any, old_state: Any) -> None:
    """Raises a clear error if an update changed its state's tree or leaf types."""
    new_paths, new_def = jax.tree_util.tree_flatten_with_path(new_state)
    old_leaves, old_def = jax.tree.flatten(old_state)
    if new_def != old_def:
        raise ValueError(
            "The inner transformation's `update` returned a state with another tree"
            f" structure than it was given: {new_def} vs {old_def}."
        )
    for (path, new), old in zip(new_paths, old_leaves, strict=True):
        old_shape, old_dtype = jnp.shape(old), jnp.result_type(old)
        if new.shape != old_shape or new.dtype != old_dtype:
            raise TypeError(
                "The inner transformation's `update` changed the state leaf at"
                f" {_where(path)} from {old_dtype}{list(old_shape)} to"
                f" {new.dtype}{list(new.shape)}; a skipped step could not keep it."
                " Initialise the inner state with the dtypes its update produces."
            )


def is_number(value: Any) -> bool:
    """Whether `value` is a real number: a Python, numpy or 0-d array scalar."""
    if isinstance(value, bool | np.bool_):
        return False
    if isinstance(value, numbers.Real):
        return True
    dtype = getattr(value, "dtype", None)
    return (
        getattr(value, "shape", None) == ()
        and dtype is not None
        and (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating))
    )


def _is_none(x: Any) -> bool:
    return x is None


def _where(path: Any) -> str:
    return jax.tree_util.keystr(path) or "<root>"
