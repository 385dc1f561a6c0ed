"""The skip in each backend's form, built from the applied step's traced jaxpr.

`guarded_step` traces the applied step (unscale, clip, the optimizer's update) once,
to a jaxpr, and builds the skip from it without tracing optax's Python again:

- `select` (XLA:GPU, TPU): the step called as traced, then per output a select
  between its value and what a skipped step keeps;
- `conds` (XLA:CPU): the step split into parts (`plan`), each called under a
  `lax.cond` of its own whose other branch keeps the part's outputs. Every equation
  of the step runs inside a cond: a skipped step computes nothing of the update.

An optimizer's update is mostly independent computations, one per leaf (Adam's two
moments and the parameter of one leaf), joined by scalars (the step count, the
learning rate, the bias corrections, the inverse scale). A part is a connected group
of the other equations, with a copy of each scalar equation it reads, so that parts
do not join through the scalars: XLA:CPU compiles one cond over thousands of
buffers in superlinear time (design.md, "The step"). Outputs are addressed by their
position among the step's outputs, never by their variable (an output may be a
constant, an input, or the same variable twice); the branches' types are made equal
with JAX's own operations (`_joined`), not compared by hand.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core.primitives import cond_p

from lossscale._src.step import inline

# The most outputs a part's cond carries (a parameter and Adam's moments of 64
# leaves): XLA:CPU's compile time grows faster than linearly in them.
PART_OUTPUTS = 192


# An output a form gives: its position among the step's outputs, and the position
# among the step's inputs of what a skipped step keeps there (None: negative zeros).
Output = tuple[int, int | None]


class Part(NamedTuple):
    """Equations of the step that give some of its outputs from some of its inputs."""

    positions: tuple[int, ...]  # the outputs it gives, by position
    held: tuple[int, ...]  # the inputs it reads, by position in `inputs(closed)`
    jaxpr: Any  # a closed jaxpr from those inputs to those outputs


def inputs(closed: Any) -> list[Any]:
    """The values a step's jaxpr reads: its constants, then its operands' places."""
    return [*closed.jaxpr.constvars, *closed.jaxpr.invars]


def plan(
    closed: Any, positions: Sequence[int], part_outputs: int = PART_OUTPUTS
) -> tuple[Part, ...]:
    """The parts that give the outputs at `positions` of the step `closed`.

    Each part holds every equation its outputs depend on; two parts share no
    equation but ones on scalars alone, which each runs on its own. A step
    with effects (a callback in the optimizer, say) stays one part, in order.
    """
    jaxpr = closed.jaxpr
    if any(eqn.effects for eqn in jaxpr.eqns):
        return _parts(jaxpr, [tuple(positions)], all_equations=True)
    groups: dict[Any, list[int]] = {}
    owners = _owners(jaxpr.eqns)
    for k in positions:
        groups.setdefault(owners(jaxpr.outvars[k]), []).append(k)
    parts: list[list[int]] = []
    batch: list[int] = []
    for group in groups.values():
        if batch and len(batch) + len(group) > part_outputs:
            parts.append(batch)
            batch = []
        batch += group
    if batch:
        parts.append(batch)
    return _parts(jaxpr, [tuple(sorted(part)) for part in parts])


def call(closed: Any, args: Sequence[Any]) -> list[Any]:
    """`closed` applied to `args`, its equations bound as they are (not traced).

    A cond of one branch, which XLA inlines (as it does `platform_dependent`'s).
    """
    return cond_p.bind(np.int32(0), *args, branches=(closed,))


def select(
    closed: Any, values: Sequence[Any], applied: jax.Array, outputs: Sequence[Output]
) -> list[Any]:
    """The step on `values` (`inputs(closed)`'s), and a select per output taken.

    `outputs` are the outputs to give, each as `(k, i)`: a skipped step gives,
    for the step's output `k`, the input at `i` as it is, or negative zeros
    where `i` is None (`p + (-0.0)` is `p`, bit for bit).
    """
    jaxpr = closed.jaxpr
    places = inputs(closed)
    taken = [
        (k, i) for k, i in outputs if i is None or jaxpr.outvars[k] is not places[i]
    ]
    effects = any(eqn.effects for eqn in jaxpr.eqns)
    (part,) = _parts(jaxpr, [tuple(k for k, _ in taken)], all_equations=effects)
    called = call(part.jaxpr, [values[i] for i in part.held])
    new = dict(zip(part.positions, called, strict=True))
    zeros = _ZerosOf()
    results = []
    for k, i in outputs:
        if k not in new and i is not None:
            results.append(values[i])  # an input the step returns as it is
            continue
        out = jaxpr.outvars[k].aval
        stay = _joined(zeros(out) if i is None else values[i], out)
        results.append(lax.select_n(applied, stay, _joined(new[k], jax.typeof(stay))))
    return results


def conds(
    closed: Any, values: Sequence[Any], applied: jax.Array, outputs: Sequence[Output]
) -> list[Any]:
    """`select`'s results, with each part of the step under a `lax.cond`."""
    closed = inline.inlined(closed)
    jaxpr = closed.jaxpr
    places = inputs(closed)
    kept = dict(outputs)
    given: dict[int, Any] = {}
    skipped = []
    for k, i in outputs:
        if i is not None and jaxpr.outvars[k] is places[i]:
            given[k] = values[i]  # an input the step returns as it is
        else:
            skipped.append(k)
    for part in plan(closed, skipped):
        stays = [kept[k] for k in part.positions]
        outs = [jaxpr.outvars[k].aval for k in part.positions]
        results = _cond(applied, part, values, stays, outs)
        given.update(zip(part.positions, results, strict=True))
    return [given[k] for k, _ in outputs]


def _cond(applied, part: Part, values, stays, outs) -> list[Any]:
    """`lax.cond(applied, part, skip)`: the part's equations bound as they are."""
    # The operands: what the part reads, then what a skip keeps that it does
    # not read. Each buffer enters the cond once.
    operands = list(part.held)
    operands += [
        i for i in dict.fromkeys(stays) if i is not None and i not in part.held
    ]
    where = {i: n for n, i in enumerate(operands)}

    def applied_part(*args):
        new = call(part.jaxpr, args[: len(part.held)])
        return [
            _joined(x, _zeros_type(out) if i is None else jax.typeof(args[where[i]]))
            for x, out, i in zip(new, outs, stays, strict=True)
        ]

    def skipped_part(*args):
        zeros = _ZerosOf()
        return [
            _joined(zeros(out) if i is None else args[where[i]], out)
            for out, i in zip(outs, stays, strict=True)
        ]

    return lax.cond(applied, applied_part, skipped_part, *(values[i] for i in operands))


def negative_zeros(aval: Any) -> jax.Array:
    """What a skipped step's updates are: `p + (-0.0)` is `p`, bit for bit."""
    return jnp.full_like(jax.ShapeDtypeStruct.like(aval), -0.0)


class _ZerosOf(dict):
    """`negative_zeros`, made once per type (a step's updates share a few)."""

    def __call__(self, aval: Any) -> jax.Array:
        if aval not in self:
            self[aval] = negative_zeros(aval)
        return self[aval]


def _zeros_type(aval: Any) -> Any:
    """The type of `negative_zeros(aval)`: never weak."""
    return aval.update(weak_type=False)


def _joined(x: Any, other: Any) -> Any:
    """`x` with the type that a select of it and a value of type `other` has.

    Weak only if both are, and varying over the `shard_map` axes either
    varies over: the two branches of a skip then have one type by construction.
    """
    mine = jax.typeof(x)
    if mine.weak_type and not other.weak_type:
        x = lax.convert_element_type(x, mine.dtype)
    missing = _varying(other) - _varying(mine)
    if missing:
        x = lax.pcast(x, tuple(sorted(missing)), to="varying")
    return x


def _varying(aval: Any) -> frozenset:
    """The `shard_map` axes a value of type `aval` varies over (jax 0.10 and on)."""
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "mat", None), "varying", None)
    return frozenset(vma or ())


def _owners(eqns: Sequence[Any]) -> Any:
    """A function from a variable to the part it belongs to (None: any part).

    Union-find over the equations that are not on scalars alone; an equation on
    scalars joins the parts of what it reads, as each part that reads its
    result must compute it, and what that needs, itself.
    """
    parent = list(range(len(eqns)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def join(found: Iterable[int]) -> int | None:
        roots = sorted({root(i) for i in found})
        for other in roots[1:]:
            parent[other] = roots[0]
        return roots[0] if roots else None

    owner: dict[Any, int] = {}
    for i, eqn in enumerate(eqns):
        found = [owner[v] for v in _vars(eqn.invars) if v in owner]
        if _on_scalars(eqn):
            joined = join(found)
            if joined is None:
                continue
        else:
            joined = join([i, *found])
        for v in _vars(eqn.outvars):
            owner[v] = joined  # type: ignore[assignment]  # not None here
    return lambda v: root(owner[v]) if isinstance(v, jcore.Var) and v in owner else None


def _parts(
    jaxpr: Any, groups: Sequence[tuple[int, ...]], all_equations: bool = False
) -> tuple[Part, ...]:
    """The part giving each group of outputs: the equations they depend on.

    One pass over the equations, last to first, whatever the number of parts
    (a step of thousands of leaves has thousands of equations and tens of parts).
    """
    places = [*jaxpr.constvars, *jaxpr.invars]
    everyone = frozenset(range(len(groups)))
    needed: dict[Any, set[int]] = {}  # a variable: the parts that read it
    for n, positions in enumerate(groups):
        for v in _vars(jaxpr.outvars[k] for k in positions):
            needed.setdefault(v, set()).add(n)
    eqns: list[list[Any]] = [[] for _ in groups]
    for eqn in reversed(jaxpr.eqns):
        if all_equations:
            readers: set[int] | frozenset[int] = everyone
        else:
            readers = set()
            for v in _vars(eqn.outvars):
                readers |= needed.get(v, set())
            if not readers:
                continue
        for n in readers:
            eqns[n].append(eqn)
        for v in _vars(eqn.invars):
            needed.setdefault(v, set()).update(readers)
    held: list[list[int]] = [[] for _ in groups]
    for i, v in enumerate(places):
        for n in needed.get(v, ()):
            held[n].append(i)
    return tuple(
        _part(jaxpr, positions, tuple(held[n]), eqns[n][::-1])
        for n, positions in enumerate(groups)
    )


def _part(
    jaxpr: Any, positions: tuple[int, ...], held: tuple[int, ...], eqns: list[Any]
) -> Part:
    """The part of `jaxpr` that runs `eqns` from the inputs at `held`."""
    places = [*jaxpr.constvars, *jaxpr.invars]
    effects = frozenset().union(*(eqn.effects for eqn in eqns))
    outvars = [jaxpr.outvars[k] for k in positions]
    debug = jcore.DebugInfo(
        "lossscale", "a part of the step", ("",) * len(held), ("",) * len(outvars)
    )
    part = jcore.Jaxpr((), [places[i] for i in held], outvars, eqns, effects, debug)
    return Part(positions, held, jcore.ClosedJaxpr(part, ()))


def _vars(atoms: Iterable[Any]) -> list[Any]:
    """The variables among `atoms`: a literal is a value, and is never looked up."""
    return [v for v in atoms if isinstance(v, jcore.Var)]


def _on_scalars(eqn: Any) -> bool:
    """Whether an equation reads and gives scalars only (cheap to run in each part)."""
    return not eqn.effects and all(
        getattr(v.aval, "shape", None) == () for v in _vars([*eqn.invars, *eqn.outvars])
    )
