"""Calls in a step's jaxpr spliced into it, so that they split into parts.

XLA:CPU's skip splits the step into parts (`split.plan`); one equation is in one
part, so a `jit` call over a whole tree would join every leaf's part into one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.extend.core as jcore


def inlined(closed: Any) -> Any:
    """`closed` with the body of each plain `jit` call that gives several values.

    From jax 0.12 on, a call jitted with `inline=True` (optax's
    `tree_bias_correction`, over the whole tree) stays one equation until
    lowering, where jax 0.10 inlined it while tracing: as one equation, it
    would join every leaf's part into one. Its body is a map over the leaves,
    which the parts then split. Only calls whose inlining XLA would do itself
    before fusing are spliced (`joins`), so XLA compiles the same program. The
    step's inputs keep their places; an output may become another variable, or
    a literal.
    """
    jaxpr = closed.jaxpr
    if not any(joins(eqn) for eqn in jaxpr.eqns):
        return closed
    renamed: dict[Any, Any] = {}
    eqns = _spliced(jaxpr.eqns, renamed)
    outvars = [_renamed(v, renamed) for v in jaxpr.outvars]
    return jcore.ClosedJaxpr(jaxpr.replace(eqns=eqns, outvars=outvars), closed.consts)


def joins(eqn: Any) -> bool:
    """Whether `eqn` is a plain `jit` call that gives more than one value.

    Plain: no effects (they keep their order as one equation), no constants (they
    would move the step's inputs), no shardings or layouts of its own
    (spliced, they would be lost), and not inlined by XLA after fusion
    (`jax.Inline.XLA_LATE`: spliced, XLA would fuse across it, other bits).
    """
    params = eqn.params
    body = params.get("jaxpr")
    if eqn.primitive.name not in ("jit", "pjit") or eqn.effects or len(eqn.outvars) < 2:
        return False
    if not isinstance(body, jcore.ClosedJaxpr) or body.consts:
        return False
    shardings = (*params.get("in_shardings", ()), *params.get("out_shardings", ()))
    layouts = (*params.get("in_layouts", ()), *params.get("out_layouts", ()))
    return (
        all(type(s).__name__ == "UnspecifiedValue" for s in shardings)
        and all(layout is None for layout in layouts)
        and getattr(params.get("inline"), "name", None) != "XLA_LATE"
    )


def _spliced(
    eqns: Sequence[Any], renamed: dict[Any, Any], fresh: bool = False
) -> list[Any]:
    """`eqns`, calls that join (`joins`) replaced by their bodies' equations.

    `renamed` maps a variable to the atom that stands for it: a call's outputs
    to what its body gives, and with `fresh` (a body's equations) each output
    to a new variable, as a body traced once may be called twice.
    """
    spliced = []
    for eqn in eqns:
        invars = [_renamed(v, renamed) for v in eqn.invars]
        if joins(eqn):
            body = eqn.params["jaxpr"].jaxpr
            inner = dict(zip(body.invars, invars, strict=True))
            spliced += _spliced(body.eqns, inner, fresh=True)
            for v, given in zip(eqn.outvars, body.outvars, strict=True):
                renamed[v] = _renamed(given, inner)
            continue
        outvars = eqn.outvars
        if fresh:
            outvars = [
                v if isinstance(v, jcore.DropVar) else jcore.Var(v.aval)
                for v in eqn.outvars
            ]
            renamed.update(zip(eqn.outvars, outvars, strict=True))
        if fresh or any(a is not b for a, b in zip(invars, eqn.invars, strict=True)):
            eqn = eqn.replace(invars=invars, outvars=outvars)
        spliced.append(eqn)
    return spliced


def _renamed(atom: Any, renamed: dict[Any, Any]) -> Any:
    """What stands for `atom` (a literal stands for itself)."""
    if isinstance(atom, jcore.Var):
        return renamed.get(atom, atom)
    return atom
