"""A loss function and its arguments, split into what is differentiated and the batch.

`locate_overflow` and `preflight` differentiate the floating-point array leaves of
`params` (an Equinox model's functions, or integer leaves, are held fixed) and pass
the array leaves of the other arguments, positional and keyword (the batch:
integers and keys included), as inputs, so that a traced program takes exactly
those arrays and an inf or NaN among them can be named.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale._src.api import grad


@dataclasses.dataclass(frozen=True)
class Program:
    """`loss_fn(params, *args, **kwargs)`, as a function of two lists of arrays."""

    loss_fn: Callable[..., Any]
    has_aux: bool
    paths: list[str]  # keystr of every leaf of `params`, None counted
    leaves: list[Any]
    treedef: Any
    differentiated: list[int]  # positions of the floating-point arrays
    arg_count: int  # len(args)
    arg_leaves: list[Any]  # of `(args, kwargs)`
    arg_keys: list[tuple[Any, ...]]  # their key paths
    arg_tree: Any
    arrays: list[int]  # positions of the arrays among `arg_leaves`

    @classmethod
    def build(
        cls,
        loss_fn: Any,
        params: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        has_aux: Any,
        example: str,
    ) -> Program:
        """Checks the arguments and splits them; raises naming the bad one.

        `example` is the call that takes them, as the error shows it
        (`"locate_overflow(loss_fn, params, x, y, loss_scale=...)"`).
        """
        if not callable(loss_fn):
            raise TypeError(
                f"`loss_fn` must be callable, got {type(loss_fn).__name__}."
            )
        if not isinstance(has_aux, bool):
            raise TypeError(f"`has_aux` must be a bool, got {has_aux!r}.")
        _validate_call(loss_fn, params, args, kwargs, example)
        # None counted as a leaf, as the step counts them: Equinox's filtered
        # parameters have None where the model has a function.
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(
            params, is_leaf=lambda x: x is None
        )
        paths = [jax.tree_util.keystr(path) for path, _ in with_paths]
        leaves = [leaf for _, leaf in with_paths]
        differentiated = [i for i, leaf in enumerate(leaves) if inexact_array(leaf)]
        if not differentiated:
            raise ValueError(
                "`params` has no floating-point array to differentiate; pass what the"
                " train step differentiates (the parameters, or the model)."
            )
        # The batch's arrays are traced too (keyword arguments included), so that
        # an inf or NaN in the data is named as such, not blamed on the first op.
        with_keys, arg_tree = jax.tree_util.tree_flatten_with_path((args, kwargs))
        arg_leaves = [leaf for _, leaf in with_keys]
        arrays = [i for i, leaf in enumerate(arg_leaves) if is_array(leaf)]
        return cls(
            loss_fn, has_aux, paths, leaves, treedef, differentiated, len(args),
            arg_leaves, [key for key, _ in with_keys], arg_tree, arrays,
        )  # fmt: skip

    @property
    def diff(self) -> list[Any]:
        """The differentiated leaves' values."""
        return [self.leaves[i] for i in self.differentiated]

    @property
    def batch(self) -> list[Any]:
        """The arguments' array leaves."""
        return [self.arg_leaves[i] for i in self.arrays]

    @property
    def diff_paths(self) -> list[str]:
        """The paths of the differentiated leaves."""
        return [self.paths[i] for i in self.differentiated]

    def input_names(self) -> list[str]:
        """The names of `[*diff, *batch]`: argument name and path (`"batch['x']"`)."""
        names = _parameter_names(self.loss_fn, self.arg_count)
        return [f"{names[0]}{path}" for path in self.diff_paths] + [
            _argument_name(self.arg_keys[i], names) for i in self.arrays
        ]

    def params(self, diff: list[Any]) -> Any:
        """`params` with `diff` in place of its floating-point arrays."""
        return _rebuild(diff, self.differentiated, self.leaves, self.treedef)

    def masked_params(self, diff: list[Any]) -> Any:
        """`params` with `diff` for its floating-point arrays and None elsewhere.

        What an optimizer is initialised with (as `eqx.filter` gives).
        """
        return _rebuild(
            diff, self.differentiated, [None] * len(self.leaves), self.treedef
        )

    def loss(self, diff: list[Any], batch: list[Any]) -> tuple[jax.Array, Any]:
        """`(loss, aux)` of `loss_fn` (aux None without `has_aux`), checked."""
        args, kwargs = _rebuild(batch, self.arrays, self.arg_leaves, self.arg_tree)
        out = self.loss_fn(self.params(diff), *args, **kwargs)
        return grad.split_loss(out, self.has_aux, "loss_fn", "loss_fn(params, ...)")


def trace(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`jax.make_jaxpr(fun, **kwargs)(*args)`, naming what cannot be traced alone.

    A loss that reduces over a mapped axis (`lax.pmean(loss, "batch")`) runs only
    inside `shard_map` or `pmap`; the check runs one device's program.
    """
    try:
        return jax.make_jaxpr(fun, **kwargs)(*args)
    except NameError as error:
        if "unbound axis name" not in str(error):
            raise
        raise ValueError(
            f"`loss_fn` reduces over a mapped axis ({error}); the check runs one"
            " device's program, outside `shard_map` and `pmap`. Pass the loss"
            " without the collective (the mean over the local batch)."
        ) from None


def tracer(*trees: Any) -> Any:
    """The first `jax.core.Tracer` among the leaves of `trees`, or None."""
    leaves = jax.tree.leaves(trees)
    return next((x for x in leaves if isinstance(x, jax.core.Tracer)), None)


def _rebuild(values: list[Any], positions: list[int], template: list, tree) -> Any:
    out = list(template)
    for i, value in zip(positions, values, strict=True):
        out[i] = value
    return jax.tree.unflatten(tree, out)


def is_array(leaf: Any) -> bool:
    """Whether `leaf` is a JAX or NumPy array (or NumPy scalar)."""
    return isinstance(leaf, jax.Array | np.ndarray | np.generic)


def inexact_array(leaf: Any) -> bool:
    """Whether `leaf` is a floating-point (or complex) array."""
    return is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.inexact)


def _validate_call(loss_fn: Any, params: Any, args: tuple, kwargs: dict, example: str):
    """Raises `TypeError` if `loss_fn(params, *args, **kwargs)` cannot bind."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # no signature to read: the call decides
        return
    try:
        signature.bind(params, *args, **kwargs)
    except TypeError as error:
        raise TypeError(
            f"`loss_fn{signature}` cannot take `(params, *args, **kwargs)` as"
            f" given ({len(args)} positional argument(s) after `params`, keywords"
            f" {sorted(kwargs)}): {error}. Pass its arguments as the train step"
            f" does: `{example}` for `loss_fn(params, x, y)`."
        ) from None


def _parameter_names(loss_fn: Callable[..., Any], count: int) -> list[str]:
    """The names `loss_fn` gives `params` and its `count` further arguments."""
    try:
        parameters = list(inspect.signature(loss_fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin)
        parameters = []
    positional = [
        p.name
        for p in parameters
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    defaults = ["params"] + [f"args[{i}]" for i in range(count)]
    return positional[: count + 1] + defaults[len(positional) :]


def _argument_name(path: tuple[Any, ...], names: list[str]) -> str:
    """A leaf of `(args, kwargs)` by its argument's name and its path inside it."""
    which, key, inside = path[0].idx, path[1], jax.tree_util.keystr(path[2:])
    return f"{names[key.idx + 1] if which == 0 else key.key}{inside}"
