"""A loss function and its arguments, split into what is differentiated and the batch.

`locate_overflow` and `preflight` differentiate the floating-point array leaves of
`params` (an Equinox model's functions, or integer leaves, are held fixed) and pass
the array leaves of the other arguments (the batch: integers and keys included) as
inputs, so that a traced program takes exactly those arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale._src import checks


@dataclasses.dataclass(frozen=True)
class Program:
    """`loss_fn(params, *args, **kwargs)`, as a function of two lists of arrays."""

    loss_fn: Callable[..., Any]
    has_aux: bool
    kwargs: dict[str, Any]
    paths: list[str]  # keystr of every leaf of `params`, None counted
    leaves: list[Any]
    treedef: Any
    differentiated: list[int]  # positions of the floating-point arrays
    arg_leaves: list[Any]
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
    ) -> Program:
        """Checks the arguments and splits them; raises naming the bad one."""
        if not callable(loss_fn):
            raise TypeError(
                f"`loss_fn` must be callable, got {type(loss_fn).__name__}."
            )
        if not isinstance(has_aux, bool):
            raise TypeError(f"`has_aux` must be a bool, got {has_aux!r}.")
        paths, leaves, treedef = flatten_with_paths(params)
        differentiated = [i for i, leaf in enumerate(leaves) if inexact_array(leaf)]
        if not differentiated:
            raise ValueError(
                "`params` has no floating-point array to differentiate; pass what the"
                " train step differentiates (the parameters, or the model)."
            )
        arg_leaves, arg_tree = jax.tree.flatten(args)
        arrays = [i for i, leaf in enumerate(arg_leaves) if is_array(leaf)]
        return cls(
            loss_fn, has_aux, kwargs, paths, leaves, treedef, differentiated,
            arg_leaves, arg_tree, arrays,
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
        out = self.loss_fn(
            self.params(diff),
            *_rebuild(batch, self.arrays, self.arg_leaves, self.arg_tree),
            **self.kwargs,
        )
        if self.has_aux:
            if not (isinstance(out, tuple | list) and len(out) == 2):
                raise TypeError(
                    "With `has_aux=True`, `loss_fn` must return a pair `(loss, aux)`;"
                    f" got {type(out).__name__}."
                )
            loss, aux = out
        else:
            loss, aux = out, None
        return checks.check_loss(loss, "loss_fn(params, ...)"), aux


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


def _rebuild(values: list[Any], positions: list[int], template: list, tree) -> Any:
    out = list(template)
    for i, value in zip(positions, values, strict=True):
        out[i] = value
    return jax.tree.unflatten(tree, out)


def flatten_with_paths(tree: Any) -> tuple[list[str], list[Any], Any]:
    """`(keystr paths, leaves, treedef)` of `tree`, `None` counted as a leaf.

    As the step counts them: Equinox's filtered parameters have None where the
    model has a function.
    """
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: x is None
    )
    paths = [jax.tree_util.keystr(path) for path, _ in with_paths]
    return paths, [leaf for _, leaf in with_paths], treedef


def is_array(leaf: Any) -> bool:
    """Whether `leaf` is a JAX or NumPy array (or NumPy scalar)."""
    return isinstance(leaf, jax.Array | np.ndarray | np.generic)


def inexact_array(leaf: Any) -> bool:
    """Whether `leaf` is a floating-point (or complex) array."""
    return is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.inexact)
