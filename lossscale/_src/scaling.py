"""Scaling the loss, unscaling gradients, checking finiteness, selecting trees."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from lossscale._src import loss_scale as loss_scale_lib


def scale_loss(loss: jax.typing.ArrayLike, loss_scale: Any) -> jax.Array:
    """Returns the loss multiplied by the loss scale.

    Differentiate the result: the gradients come out multiplied by the scale, which
    keeps small float16 gradients from underflowing. A float16 or bfloat16 loss is
    promoted to float32 first, so the scaled loss itself cannot overflow (gradients
    flowing back into float16 computations still can; that is what the dynamic
    scale detects).

    Args:
      loss: the loss, a floating-point scalar.
      loss_scale: a loss-scale state, a number, `"dynamic"`, `None`, or an
        optimizer state holding a loss-scale state (e.g. that of `lossscale.wrap`).

    Returns:
      `loss * scale`, in float32 (or in the loss's dtype if wider).

    Raises:
      TypeError: if `loss` is not a floating-point array or `loss_scale` is not
        one of the above.
      ValueError: if `loss` is not a scalar.

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale
      >>> scaled = lossscale.scale_loss(jnp.float16(0.5), 1024)
      >>> print(scaled, scaled.dtype)
      512.0 float32
    """
    state = loss_scale_lib.resolve_loss_scale(loss_scale)
    loss = _check_loss(loss)
    loss = loss.astype(_at_least_float32(loss.dtype))
    if isinstance(state, loss_scale_lib.NoOpLossScale):
        return loss
    return loss * state.scale.astype(loss.dtype)


def unscale_grads(grads: Any, loss_scale: Any) -> Any:
    """Divides every gradient by the loss scale, keeping each leaf's dtype.

    Each leaf is multiplied by `1 / scale` (computed in float32, as TF does) in
    float32 or wider, and rounded once to the leaf's dtype. For a power-of-two
    scale (the dynamic scale's defaults keep it one) this is exactly the quotient.
    `None` leaves pass through. Keep parameters, and hence gradients, in float32:
    unscaling into a float16 leaf loses again what scaling kept from underflowing.

    Args:
      grads: a pytree of floating-point gradients of the scaled loss.
      loss_scale: a loss-scale state, a number, `"dynamic"`, `None`, or an
        optimizer state holding a loss-scale state.

    Returns:
      The gradients divided by the scale, same tree and dtypes.

    Raises:
      TypeError: if a gradient leaf is not floating point (or complex).

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale
      >>> grads = {"w": jnp.array([1024.0, 2048.0]), "b": None}
      >>> print(lossscale.unscale_grads(grads, 1024)["w"])
      [1. 2.]
    """
    state = loss_scale_lib.resolve_loss_scale(loss_scale)
    check_gradients(grads)
    return unscale(grads, state)


def all_finite(tree: Any, axis_name: AxisName | None = None) -> jax.Array:
    """Returns True when every element of every leaf of `tree` is finite.

    One reduction per leaf, reading each leaf once: `sum(x - x)` is 0 when `x` is
    finite and NaN otherwise, and unlike a plain sum it cannot overflow (where
    `jnp.all(jnp.isfinite(x))` makes XLA:CPU write a byte per element first; for
    16-bit leaves that byte is the cheaper of the two, so they use it).
    Integer and boolean leaves are always finite; `None` leaves are ignored.

    Under `jax.jit` with sharded arrays the result is already global: the
    reductions are over whole arrays, and XLA adds the cross-device reduction.
    Inside `shard_map` or `pmap` each device sees only its own shards; pass the
    mapped axis as `axis_name` to get one answer, the same on every device.

    Args:
      tree: any pytree of arrays.
      axis_name: a mapped axis name (or tuple of names) of `shard_map`/`pmap` to
        agree over: True only if every device's tree is finite.

    Returns:
      A boolean scalar array.

    Raises:
      TypeError: if `axis_name` is not a string or a tuple of strings.

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
    check_axis_name(axis_name)
    return agree(_all_finite_leaves(jax.tree.leaves(tree)), axis_name)


def select_tree(pred: jax.typing.ArrayLike, on_true: Any, on_false: Any) -> Any:
    """Picks `on_true` or `on_false`, leaf by leaf, by a scalar predicate.

    Both trees must have the same structure, shapes and dtypes. Inside `jax.jit`
    this is an elementwise select over every leaf; prefer `jax.lax.cond` when the
    trees are large and the alternative is just to keep the old values (as
    `lossscale.wrap` does).

    Args:
      pred: boolean scalar.
      on_true: the tree returned where `pred` is True.
      on_false: the tree returned where `pred` is False.

    Returns:
      A tree like `on_true`.

    Raises:
      TypeError: if `pred` is not boolean, or leaves differ in dtype.
      ValueError: if `pred` is not a scalar, or the trees differ in structure or
        leaf shapes.

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale
      >>> new, old = {"w": jnp.array([1.0, 2.0])}, {"w": jnp.array([0.0, 0.0])}
      >>> print(lossscale.select_tree(jnp.array(False), new, old)["w"])
      [0. 0.]
    """
    pred = loss_scale_lib.as_predicate("pred", pred)
    true_leaves, true_def = jax.tree.flatten(on_true)
    false_leaves, false_def = jax.tree.flatten(on_false)
    if true_def != false_def:
        raise ValueError(
            "`on_true` and `on_false` must have the same tree structure, got"
            f" {true_def} and {false_def}."
        )
    for index, (a, b) in enumerate(zip(true_leaves, false_leaves, strict=True)):
        a, b = jnp.asarray(a), jnp.asarray(b)
        if a.shape != b.shape:
            raise ValueError(
                f"`select_tree`: leaf {index} has shape {a.shape} in `on_true` but"
                f" {b.shape} in `on_false`."
            )
        if a.dtype != b.dtype:
            raise TypeError(
                f"`select_tree`: leaf {index} has dtype {a.dtype} in `on_true` but"
                f" {b.dtype} in `on_false`."
            )
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


# -- shared with the optax wrapper ------------------------------------------------

AxisName = str | tuple[str, ...]


def check_axis_name(axis_name: Any) -> None:
    """Raises `TypeError` unless `axis_name` is None, a str or a tuple of str."""
    if axis_name is None or isinstance(axis_name, str):
        return
    if (
        isinstance(axis_name, tuple)
        and axis_name
        and all(isinstance(name, str) for name in axis_name)
    ):
        return
    raise TypeError(
        "`axis_name` must be None, a mapped axis name (a str) or a non-empty tuple"
        f" of them, got {axis_name!r}."
    )


def agree(flags: jax.Array, axis_name: AxisName | None) -> jax.Array:
    """Boolean flags, True only where they hold on every device of `axis_name`.

    Several flags go in one array, so they cost one scalar collective together.
    """
    if axis_name is None:
        return flags
    return jax.lax.pmin(flags.astype(jnp.int32), axis_name) == 1


def unscale(grads: Any, state: loss_scale_lib.LossScale, params: Any = None) -> Any:
    """`unscale_grads` for checked gradients and a resolved state.

    With `params`, a gradient leaf narrower than its parameter is unscaled into the
    parameter's dtype (see `_unscaled_dtypes`).
    """
    if isinstance(state, loss_scale_lib.NoOpLossScale):
        return grads
    inverse_scale = _inverse(state.scale)
    leaves, treedef = _flatten_keeping_none(grads)
    dtypes = _unscaled_dtypes(leaves, treedef, params)
    return treedef.unflatten(
        [
            g if g is None else _unscale_wide(g, inverse_scale).astype(dtype)
            for g, dtype in zip(leaves, dtypes, strict=True)
        ]
    )


def _flatten_keeping_none(tree: Any) -> tuple[list[Any], Any]:
    return jax.tree.flatten(tree, is_leaf=lambda x: x is None)


def _unscaled_dtypes(leaves: list[Any], treedef: Any, params: Any) -> list[Any]:
    """The dtype each gradient leaf is unscaled into.

    A leaf's own dtype, unless its parameter is wider (float16 gradients of float32
    parameters): then the parameter's. Casting up first keeps the small unscaled
    values that a float16 result would flush to zero (what the scale was for), and
    the optimizer widens them to the parameter's dtype anyway. It is also cheaper:
    XLA fuses a widening multiply into the optimizer's pass, where a round trip
    through bfloat16 (a software rounding on CPU) is materialised first.
    """
    dtypes = [None if g is None else jnp.result_type(g) for g in leaves]
    if params is None:
        return dtypes
    for i, (dtype, param) in enumerate(
        zip(dtypes, treedef.flatten_up_to(params), strict=True)
    ):
        param_dtype = getattr(param, "dtype", None)
        if (
            dtype is not None
            and param_dtype is not None
            and jnp.issubdtype(param_dtype, jnp.floating)
            and jnp.dtype(param_dtype).itemsize > dtype.itemsize
        ):
            dtypes[i] = jnp.dtype(param_dtype)
    return dtypes


def check_gradients(grads: Any, params: Any = None) -> None:
    """Raises a clear error for non-float gradient leaves or mismatched trees."""
    paths_and_leaves, _ = jax.tree_util.tree_flatten_with_path(grads)
    for path, leaf in paths_and_leaves:
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
            where = jax.tree_util.keystr(path) or "<root>"
            raise TypeError(
                f"Gradients must be floating-point arrays; the leaf at {where} has"
                f" dtype {dtype} ({type(leaf).__name__}). Differentiate with respect"
                " to floating-point parameters only."
            )
    if params is not None:
        # None marks a masked-out leaf in optax: compare structures up to it.
        def is_none(x):
            return x is None

        grads_def = jax.tree.structure(grads, is_leaf=is_none)
        params_def = jax.tree.structure(params, is_leaf=is_none)
        if grads_def != params_def:
            raise ValueError(
                "The gradients and `params` must have the same tree structure, got"
                f" {grads_def} and {params_def}."
            )


def finite_after_unscale(
    grads: Any, state: loss_scale_lib.LossScale, params: Any = None
) -> jax.Array:
    """Whether `unscale(grads, state, params)` is finite, in one pass over `grads`.

    Dividing by a scale >= 1 cannot overflow, so then the check reads `grads` as
    they are. Below 1 the division can overflow a narrow result (a float16 gradient
    of 40000 under a scale of 0.5), so the check reduces the unscaled values, which
    XLA fuses into the same reduction pass.
    """
    if state._lowest_scale < 1.0:
        return _all_finite_leaves(_unscaled_or_inf_leaves(grads, state, params))
    return _all_finite_leaves(jax.tree.leaves(grads))


def global_norm_after_unscale(
    grads: Any, state: loss_scale_lib.LossScale, params: Any = None
) -> jax.Array:
    """The global norm of `unscale(grads, state, params)`, in one pass over `grads`.

    It is NaN or inf exactly when an unscaled gradient is, so it doubles as the
    finiteness check. For scales >= 1 it is the norm of the *scaled* gradients
    times `1/scale`: the squares are summed in the scaled domain, where an
    overflow of a square (|g| > 1.8e19 in float32) looks like a gradient overflow,
    the step is skipped and the scale backs off, which brings the squares back in
    range.
    """
    if state._lowest_scale < 1.0:
        return jnp.sqrt(_sum_of_squares(_unscaled_or_inf_leaves(grads, state, params)))
    wide = [g.astype(_at_least_float32(g.dtype)) for g in jax.tree.leaves(grads)]
    return jnp.sqrt(_sum_of_squares(wide)) * _inverse(state.scale)


def _unscaled_or_inf_leaves(
    grads: Any, state: loss_scale_lib.LossScale, params: Any
) -> list[jax.Array]:
    """The leaves of `unscale(grads, state, params)`, wide, inf where they overflow."""
    leaves, treedef = _flatten_keeping_none(grads)
    dtypes = _unscaled_dtypes(leaves, treedef, params)
    inverse_scale = _inverse(state.scale)
    return [
        _unscaled_or_inf(g, inverse_scale, dtype)
        for g, dtype in zip(leaves, dtypes, strict=True)
        if g is not None
    ]


def _sum_of_squares(leaves: list[jax.Array]) -> jax.Array:
    total = jnp.zeros([], jnp.float32)
    for leaf in leaves:
        total = total + jnp.sum(jnp.square(leaf)).astype(jnp.float32)
    return total


def clip(grads: Any, norm: jax.Array, max_norm: float) -> Any:
    """`optax.clip_by_global_norm(max_norm)` of `grads`, whose global norm is `norm`."""
    factor = jnp.where(norm < max_norm, jnp.ones([], norm.dtype), max_norm / norm)
    return jax.tree.map(lambda g: g * factor.astype(g.dtype), grads)


def loss_is_finite(value: Any) -> jax.Array:
    """Whether the loss `value` (a float scalar) is finite; checks its type."""
    return jnp.isfinite(_check_loss(value, "value"))


def _unscaled_or_inf(
    grad: jax.Array, inverse_scale: jax.Array, dtype: Any
) -> jax.Array:
    """The unscaled leaf in float32 or wider, inf where `dtype` overflows."""
    value = _unscale_wide(grad, inverse_scale)
    if value.dtype == dtype:
        return value
    # Compare with the rounding threshold instead of casting down and back up:
    # XLA:GPU removes such a round trip (it allows excess precision), which hid
    # the overflow. Values at or above max + ulp/2 round to inf.
    finfo = jnp.finfo(dtype)
    top_ulp = 2.0 ** (finfo.maxexp - 1) * float(finfo.eps)
    threshold = jnp.asarray(float(finfo.max) + top_ulp / 2, value.dtype)
    infinity = jnp.asarray(jnp.inf, value.dtype)
    return jnp.where(jnp.abs(value) < threshold, value, infinity)


def _all_finite_leaves(leaves: list[Any]) -> jax.Array:
    checks = []
    for leaf in leaves:
        leaf = jnp.asarray(leaf)
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            continue
        if leaf.dtype == jnp.bfloat16:
            # XLA:CPU computes bfloat16 arithmetic in float32, and a convert stops
            # its reduction fusion; max and min read the leaf as it is (and
            # propagate NaN): two reads, no temporary array.
            checks.append(jnp.isfinite(jnp.max(leaf)) & jnp.isfinite(jnp.min(leaf)))
            continue
        if leaf.dtype.itemsize < 4:
            # Neither `sum(x - x)` nor `all(isfinite(x))` fuses into one XLA:CPU
            # reduction for float16 (both write a whole array first). A reducer of
            # its own does: it maps both operands to 0 (finite) or NaN, so partial
            # results combine in any order, and a finite `x - x` is exactly 0.
            zero = jnp.zeros([], leaf.dtype)
            dims = tuple(range(leaf.ndim))
            checks.append(jnp.isfinite(jax.lax.reduce(leaf, zero, _zero_or_nan, dims)))
            continue
        # `x - x` is 0 where `x` is finite and NaN elsewhere, and a sum of zeros
        # cannot overflow. Unlike `x * 0` it has no broadcast constant, which
        # XLA:CPU's reduction fusion would materialise as a whole array.
        checks.append(jnp.isfinite(jnp.sum(leaf - leaf)))
    return functools.reduce(jnp.logical_and, checks, jnp.asarray(True))


def _zero_or_nan(a: jax.Array, b: jax.Array) -> jax.Array:
    return (a - a) + (b - b)


def _unscale_wide(grad: jax.Array, inverse_scale: jax.Array) -> jax.Array:
    # The one definition of the unscaled value: the check and the applied branch
    # must agree on it exactly.
    wide = _at_least_float32(grad.dtype)
    return grad.astype(wide) * inverse_scale.astype(wide)


def _at_least_float32(dtype) -> jnp.dtype:
    # Explicit, so it also holds under `jax_numpy_dtype_promotion="strict"`.
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.float32) if dtype.itemsize < 4 else dtype


def _inverse(scale: jax.Array) -> jax.Array:
    # A multiply by the reciprocal, not a division: XLA duplicates a cheap multiply
    # into every consumer (Adam's two moments), but materialises a divide as a pass
    # of its own. For power-of-two scales the two are bit-identical.
    return jnp.ones([], jnp.float32) / scale


def _check_loss(loss: Any, name: str = "loss") -> jax.Array:
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
