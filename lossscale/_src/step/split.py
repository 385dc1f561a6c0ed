"""The applied step split into its independent parts, for XLA:CPU's form of the skip.

An optimizer's update is mostly independent computations, one per leaf (Adam's two
moments and the parameter of one leaf), joined only by scalars (the step count, the
learning rate, the bias corrections, the inverse scale). `plan` reads that off the
step's jaxpr: the equations on scalars, which run before the skip, and the connected
parts of the rest, grouped into parts of at most `PART_OUTPUTS` outputs, each of
which `conds` runs under a `lax.cond` of its own: XLA:CPU compiles one cond over
thousands of buffers in superlinear time (design.md, "The step"). The parts are
the traced step's own equations, put into the conds as they are: nothing is
traced twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.extend.core as jcore
import numpy as np
from jax import lax
from jax.extend.core.primitives import cond_p
from jax.extend.core.primitives import select_n_p

# The most outputs a part's cond carries (a parameter and Adam's moments of 64
# leaves): XLA:CPU's compile time grows faster than linearly in them.
PART_OUTPUTS = 192


class Part(NamedTuple):
    """Connected equations of the step, and the step's outputs they give."""

    eqns: tuple[Any, ...]
    inputs: tuple[Any, ...]  # the variables it reads and does not define
    outputs: tuple[Any, ...]  # the variables it gives
    positions: tuple[int, ...]  # where they are among the step's outputs


class Plan(NamedTuple):
    """A step's jaxpr as equations on scalars and independent parts."""

    closed: Any  # the step's `ClosedJaxpr`
    scalars: Part | None  # equations on scalars only: the step count, rates, ...
    parts: tuple[Part, ...]


def plan(closed: Any, part_outputs: int = PART_OUTPUTS) -> Plan:
    """Splits the closed jaxpr of a step into its scalar part and other parts.

    A step with effects (a callback in the optimizer, say) stays one part.
    """
    jaxpr = closed.jaxpr
    if any(eqn.effects for eqn in jaxpr.eqns):
        return Plan(closed, None, (_part(jaxpr.eqns, jaxpr.outvars),))
    scalar = {v for v in (*jaxpr.constvars, *jaxpr.invars) if _is_scalar(v)}
    scalar_eqns, rest = [], []
    for eqn in jaxpr.eqns:
        reads = (v for v in eqn.invars if not isinstance(v, jcore.Literal))
        if all(map(_is_scalar, eqn.outvars)) and all(v in scalar for v in reads):
            scalar_eqns.append(eqn)
            scalar.update(eqn.outvars)
        else:
            rest.append(eqn)
    parts: list = []
    batch: list = []
    count = 0
    outputs = set(jaxpr.outvars)
    for group in _connected(rest):
        defined = sum(v in outputs for eqn in group for v in eqn.outvars)
        if batch and count + defined > part_outputs:
            parts.append(_part(batch, jaxpr.outvars))
            batch, count = [], 0
        batch += group
        count += defined
    if batch:
        parts.append(_part(batch, jaxpr.outvars))
    scalars = None
    if scalar_eqns:
        read = {v for part in parts for v in part.inputs} | outputs
        wanted = [v for eqn in scalar_eqns for v in eqn.outvars if v in read]
        scalars = _part(scalar_eqns, wanted)
    return Plan(closed, scalars, tuple(parts))


def conds(
    step: Plan, operands: Sequence[Any], applied: jax.Array, kept: Sequence[int | None]
) -> tuple[list, set[int]]:
    """The step on `operands` (its flat inputs), each part under a `lax.cond`.

    The scalar equations run first, on every step. A skipped part gives, for the
    step's output `k`, the operand at `kept[k]` as it is, or negative zeros
    where `kept[k]` is None (`p + (-0.0)` is `p` bit for bit, `-0.0` too).

    Returns:
      The flat outputs, and the positions that a cond gave: the others are
      scalars or operands passed through, for the caller to keep or not.
    """
    jaxpr = step.closed.jaxpr
    values = dict(zip(jaxpr.constvars, step.closed.consts, strict=True))
    values.update(zip(jaxpr.invars, operands, strict=True))
    if step.scalars is not None:
        scalars = step.scalars
        run = jcore.jaxpr_as_fun(_jaxpr(scalars.inputs, scalars.outputs, scalars.eqns))
        results = run(*(values[v] for v in scalars.inputs))
        values.update(zip(scalars.outputs, results, strict=True))
    given: dict[int, Any] = {}
    for part in step.parts:
        keep = [kept[k] for k in part.positions]
        held = (*part.inputs, *(jaxpr.invars[i] for i in keep if i is not None))
        held = tuple(dict.fromkeys(held))  # each buffer enters the cond once
        results = _cond(applied, part, held, keep, [values[v] for v in held], jaxpr)
        given.update(zip(part.positions, results, strict=True))
    outputs = [
        given[k] if k in given else _value(v, values)
        for k, v in enumerate(jaxpr.outvars)
    ]
    return outputs, set(given)


def select(
    step: Any, operands: Sequence[Any], applied: jax.Array, kept: Sequence[int | None]
) -> list | None:
    """The step on `operands`, and a select per output between it and the skip's.

    A skipped step keeps what `conds` keeps. Returns None where the types of the
    two differ.

    The selects are put in the step's jaxpr, not traced: a call of it with the
    selects added, which XLA inlines (as it does `platform_dependent`'s own).
    `step` is the step's closed jaxpr.
    """
    jaxpr = step.jaxpr
    zeros = {}
    for out, i in zip(jaxpr.outvars, kept, strict=True):
        if i is None and out.aval not in zeros:
            zeros[out.aval] = negative_zeros(out.aval)
    pred = jcore.Var(jax.typeof(applied))
    zero_vars = {aval: jcore.Var(jax.typeof(value)) for aval, value in zeros.items()}
    eqns, outputs = list(jaxpr.eqns), []
    for out, i in zip(jaxpr.outvars, kept, strict=True):
        stay = zero_vars[out.aval] if i is None else jaxpr.invars[i]
        if stay is out:
            outputs.append(out)  # an input the step returns as it is
            continue
        if stay.aval != out.aval:
            return None  # a `shard_map` typing or a weak type: `lax.select_n`'s
        new = jcore.Var(out.aval)
        eqns.append(
            jcore.new_jaxpr_eqn([pred, stay, out], [new], select_n_p, {}, frozenset())
        )
        outputs.append(new)
    inputs = [pred, *zero_vars.values(), *jaxpr.constvars, *jaxpr.invars]
    branch = _jaxpr(inputs, outputs, eqns)
    values = [applied, *zeros.values(), *step.consts, *operands]
    return cond_p.bind(np.int32(0), *values, branches=(branch,))


def negative_zeros(aval: Any) -> jax.Array:
    """What a skipped step's updates are: `p + (-0.0)` is `p`, bit for bit."""
    return jax.numpy.full_like(jax.ShapeDtypeStruct.like(aval), -0.0)


def _cond(applied, part, held, keep, operands, jaxpr):
    """`lax.cond(applied, part, skip)`, with the part's equations bound as they are."""
    # In the outputs' order (a set's would vary): the same program every time.
    zeros = dict.fromkeys(
        jaxpr.outvars[k].aval
        for k, i in zip(part.positions, keep, strict=True)
        if i is None
    )
    made = jax.make_jaxpr(lambda: [negative_zeros(aval) for aval in zeros])()
    made_for = dict(zip(zeros, made.jaxpr.outvars, strict=True))
    skipped = [
        made_for[out.aval] if i is None else jaxpr.invars[i]
        for out, i in zip(part.outputs, keep, strict=True)
    ]
    false = _jaxpr(held, skipped, made.jaxpr.eqns)
    branch = _jaxpr(held, part.outputs, part.eqns)
    if not made.consts and false.out_avals == branch.out_avals:
        index = lax.convert_element_type(applied, np.int32)
        return cond_p.bind(index, *operands, branches=(false, branch))
    # Types the branches differ in (a `shard_map` typing that `lax.cond`
    # reconciles): the slower path, which traces the part again.
    where = {v: i for i, v in enumerate(held)}
    return lax.cond(
        applied,
        jcore.jaxpr_as_fun(branch),
        lambda *values: [
            values[where[v]] if v in where else negative_zeros(v.aval) for v in skipped
        ],
        *operands,
    )


def _value(v: Any, values: dict) -> Any:
    if isinstance(v, jcore.Literal):
        return np.asarray(v.val, v.aval.dtype)  # type: ignore[attr-defined]  # a shaped aval
    return values[v]


def _connected(eqns: list) -> list[list]:
    """The equations grouped into connected parts, each in the jaxpr's order."""
    parent = list(range(len(eqns)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    producer: dict[Any, int] = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            j = None if isinstance(v, jcore.Literal) else producer.get(v)
            if j is not None:  # not a literal, nor an input of the step
                a, b = root(i), root(j)
                if a != b:
                    parent[max(a, b)] = min(a, b)
        for v in eqn.outvars:
            producer[v] = i
    groups: dict[int, list] = {}
    for i, eqn in enumerate(eqns):
        groups.setdefault(root(i), []).append(eqn)
    return list(groups.values())


def _part(eqns: Sequence[Any], wanted: Sequence[Any]) -> Part:
    """`eqns` as a part giving the variables of `wanted` that they define."""
    defined: set = set()
    inputs: dict = {}
    for eqn in eqns:
        for v in eqn.invars:
            if isinstance(v, jcore.Var) and v not in defined:
                inputs.setdefault(v, None)
        defined.update(eqn.outvars)
    positions = tuple(k for k, v in enumerate(wanted) if v in defined)
    outputs = tuple(wanted[k] for k in positions)
    return Part(tuple(eqns), tuple(inputs), outputs, positions)


def _jaxpr(inputs: Sequence[Any], outputs: Sequence[Any], eqns: Sequence[Any]) -> Any:
    """A closed jaxpr of `eqns`, from `inputs` (a superset of theirs) to `outputs`."""
    effects = frozenset().union(*(eqn.effects for eqn in eqns))
    debug = jcore.DebugInfo(
        "lossscale", "a part of the step", ("",) * len(inputs), ("",) * len(outputs)
    )
    jaxpr = jcore.Jaxpr((), tuple(inputs), list(outputs), list(eqns), effects, debug)
    return jcore.ClosedJaxpr(jaxpr, ())


def _is_scalar(v: Any) -> bool:
    return getattr(v.aval, "shape", None) == ()
