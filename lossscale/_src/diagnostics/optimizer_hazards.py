"""The optimizer's hazards: constants that round away, updates that round away.

One probe update from a fresh optimizer state, on the probe's gradients and on
gradients of zero (a dead ReLU, an unused embedding row), in the dtypes the
program uses, against the same update with every floating-point leaf in
float32. An update that is not finite (or is 8x larger) where float32's is
finite comes from a constant or state value that rounds to zero or a subnormal,
such as Adam's `eps=1e-8` in float16. A 16-bit parameter that the update leaves
unchanged (`p + u == p`, `u != 0`) does not train.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lossscale._src.diagnostics.engine import interpret
from lossscale._src.diagnostics.engine.program import Program
from lossscale._src.diagnostics.findings import Finding
from lossscale._src.diagnostics.findings import listed
from lossscale._src.diagnostics.holders import with_loss_scale
from lossscale._src.state.kinds import NoOpLossScale

# An update this much larger than float32's is "huge" (a subnormal denominator).
HUGE = 8.0
# More than this share of a 16-bit parameter's probe update rounding away.
ROUNDED_AWAY_LIMIT = 0.10
# The frames of optax's own code name the op (`update_fn` of `scale_by_adam`).
_NOT_OPTAX = ("jax", "jaxlib", "flax", "equinox", "haiku")


def check(
    problem: Program, optimizer: optax.GradientTransformation, grads: list[Any]
) -> list[Finding]:
    """Runs the probe updates; `grads` are the unscaled float32 gradients."""
    params = problem.masked_params(problem.diff)
    dtypes = [np.dtype(leaf.dtype) for leaf in problem.diff]
    # The probe feeds unscaled gradients: `wrap(inner)` then runs `inner` on them.
    state = with_loss_scale(optimizer.init(params), NoOpLossScale())
    if not any(_half(leaf) for leaf in jax.tree.leaves((params, state))):
        return []  # float32 throughout: nothing rounds differently
    # The reference starts from its own float32 state: a constant that `init`
    # stores in the parameters' dtype (`inject_hyperparams`' `eps`) is rounded
    # there already, and a cast back would keep the rounded value.
    wide_state = with_loss_scale(optimizer.init(_float32(params)), NoOpLossScale())
    findings = []
    probe = problem.masked_params(
        [np.asarray(g).astype(d) for g, d in zip(grads, dtypes, strict=True)]
    )
    zeros = problem.masked_params([np.zeros(d.shape, d.dtype) for d in problem.diff])
    broken = None
    update = jax.jit(lambda g, s, p: optimizer.update(g, s, p)[0])
    wide = jax.jit(lambda g, s, p: optimizer.update(*_float32((g, s, p)))[0])
    for name, g in (("the probe's gradients", probe), ("gradients of zero", zeros)):
        updates = _leaves(jax.device_get(update(g, state, params)))
        reference = _leaves(jax.device_get(wide(g, wide_state, params)))
        if name == "the probe's gradients":
            findings += _rounded_away(problem, updates)
        if broken is None:
            broken = _broken(updates, reference, problem.paths, name)
            if broken is not None:  # name the op that made it
                op = _first_nonfinite(optimizer, g, state, params)
                broken = dataclasses.replace(broken, message=broken.message + op)
    return ([broken] if broken else []) + findings


def _first_nonfinite(optimizer, grads, state, params) -> str:
    """Which op of the update made a non-finite value from finite ones, if any.

    Walked one op at a time (slow): only once something is found.
    """
    closed = jax.make_jaxpr(optimizer.update)(grads, state, params)
    found: list[str] = []

    def visit(eqn, inputs, outputs, tags, calls):
        if not found and interpret._produced(inputs, outputs):
            place, function = interpret.source(eqn, _NOT_OPTAX, calls)
            where = ""
            if place:  # e.g. `scale_by_adam.update_fn` (optax/_src/transform.py:300)
                function = function.replace(".<locals>", "").removesuffix(".<lambda>")
                where = f" in `{function}` ({place.split('site-packages/')[-1]})"
            found.append(f"`{eqn.primitive.name}`{where}")

    leaves = jax.tree.leaves((grads, state, params))
    interpret.walk(closed, leaves, visit, descend=lambda: not found, branches=True)
    return f" The first non-finite value comes from {found[0]}." if found else ""


def _broken(updates, reference, paths, name) -> Finding | None:
    for path, ours, theirs in zip(paths, updates, reference, strict=True):
        if ours is None or theirs is None:
            continue
        ours, theirs = np.asarray(ours, np.float32), np.asarray(theirs, np.float32)
        lost = ~np.isfinite(ours) & np.isfinite(theirs)
        largest = float(np.max(np.abs(theirs), initial=0.0))
        huge = np.abs(np.where(np.isfinite(ours), ours, 0)) > HUGE * largest
        if not (lost.any() or huge.any()):
            continue
        what = "not finite" if lost.any() else f"over {HUGE:g}x float32's largest"
        return Finding(
            code="optimizer-underflow",
            severity="error",
            message=(
                f"On {name}, {int((lost | huge).sum())} elements of the probe"
                f" update of {path} are {what}, where the same update in float32"
                f" is finite: a constant or state value of the optimizer (such as"
                f" Adam's `eps=1e-8`, 0 in float16) rounds to zero or a subnormal"
                f" in the dtype it is used in."
            ),
            where=path,
            fix=(
                "Keep float32 master parameters (`param_dtype=jnp.float32`; the"
                " optimizer state follows them) and compute in float16; if they"
                " must be 16-bit, use constants that dtype holds (Adam:"
                " `eps=1e-4`; `mu_dtype=jnp.float32` leaves `nu` 16-bit)."
            ),
        )
    return None


def _rounded_away(problem: Program, updates: list[Any]) -> list[Finding]:
    shares = {}
    for path, p, u in zip(problem.paths, problem.leaves, updates, strict=True):
        if u is None or not _half(p):
            continue
        p, u = np.asarray(p), np.asarray(u)
        # As `optax.apply_updates`: the sum in the wider dtype, cast back.
        new = (p + u).astype(p.dtype)
        moved = (u != 0) & np.isfinite(u)
        lost = int(np.sum(moved & (new == p)))
        if lost > ROUNDED_AWAY_LIMIT * max(int(np.sum(moved)), 1):
            shares[path] = lost / int(np.sum(moved))
    if not shares:
        return []
    worst = max(shares, key=lambda path: shares[path])
    named = listed([f"{p} {s:.0%}" for p, s in shares.items()])
    dtype = np.dtype(problem.leaves[problem.paths.index(worst)].dtype).name
    return [
        Finding(
            code="update-underflow",
            severity="warning",
            message=(
                f"The probe update rounds away (`p + u == p` with `u != 0`) in"
                f" {dtype} parameters: {named} of their nonzero updates."
                " Those parameters move slower than the optimizer says, or not"
                " at all."
            ),
            where=worst,
            fix=(
                "Keep float32 master weights (`param_dtype=jnp.float32`) and"
                " compute in 16 bits (`dtype=jnp.float16`): the update is added in"
                " float32."
            ),
        )
    ]


def _half(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", np.int32)
    return jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype).itemsize <= 2


def _float32(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32) if _half(x) else x, tree)


def _leaves(tree: Any) -> list[Any]:
    """The leaves of `tree`, None counted, as `Program.paths` counts them."""
    return jax.tree.leaves(tree, is_leaf=lambda x: x is None)
