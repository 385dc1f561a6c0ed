"""The probe: the scaled `value_and_grad` on one batch, instrumented, jitted once.

`interpret.walk` evaluates the jaxpr of `value_and_grad(loss * scale)` under
`jax.jit`, and measures values on the way, as extra outputs of one compiled
program:

* the forward pass (the equations that the loss depends on and the scale does
  not): the largest magnitude of each float16 output, and which measured values
  or inputs each op's inputs, and the loss, come from (their nearest measured
  ancestors; whether an input is finite is read on the host);
* the backward pass (the values computed from the scale): the largest magnitude
  of each float16 value. The backward pass is linear in the scale, so at scale
  `s` it overflows from about `s * 65520 / max` on.

It compiles with `xla_allow_excess_precision` off, so that every float16 value is
rounded to float16 as the program says, on every backend (XLA:GPU may otherwise
keep a chain of float16 ops in float32). Ops that only move values (reshape,
slice, broadcast, a widening cast) are not measured: they make no new magnitude;
nor are the backward pass's sums of two values (`add`), which at most double
one: the evaluation at twice the estimated scale catches that. XLA:CPU compiles
a kernel per measured value, which is why the probe measures no more.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core

from lossscale._src.diagnostics.engine import interpret
from lossscale._src.diagnostics.engine.program import Program
from lossscale._src.diagnostics.engine.program import trace
from lossscale._src.step import unscaling

F16 = np.dtype(np.float16)
# Values at or above max + ulp/2 round to inf in float16.
F16_OVERFLOW = unscaling.overflow_threshold(np.float16)
# Outputs no larger than an input, and finite when it is.
_MOVES = {
    "reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims", "slice",
    "dynamic_slice", "rev", "copy", "copy_p", "neg", "abs", "stop_gradient",
    "pad", "concatenate", "select_n", "gather", "real", "imag",
}  # fmt: skip
_SUMS_OF_TWO = {"add", "add_any", "sub"}


@dataclasses.dataclass(frozen=True)
class Op:
    """A forward equation measured: its values, and the measured ones it reads."""

    eqn: Any
    calls: tuple[Any, ...]  # the call equations it is inside (`interpret.walk`)
    upstream: frozenset[int]  # indices into `Evaluation.peaks`: nearest ancestors
    outputs: tuple[int, ...]  # its float16 outputs' indices (after the inputs')


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """The probe batch at one scale."""

    scale: float
    loss: float
    grads: list[np.ndarray]  # scaled, in the gradient leaves' dtypes
    finite: bool  # the loss and every gradient
    # The inputs (0: not measured), then the float16 forward values: the
    # largest magnitude of each (0 if bad), and whether it holds an inf or a NaN.
    peaks: np.ndarray
    bad: np.ndarray
    limit: float  # the scale from which a float16 backward value overflows
    first_overflow: Any  # (equation, calls) that overflowed first, or None
    # The measured forward values that the non-finite forward values the
    # backward pass reads come from (nearest): empty if it reads none.
    read_bad: frozenset[int]


class Probe:
    """The instrumented `value_and_grad` of `problem`; call it with a scale."""

    def __init__(self, problem: Program):
        def scaled(diff, batch, scale):
            loss, _ = problem.loss(diff, batch)
            wide = loss.astype(jnp.promote_types(loss.dtype, jnp.float32))
            return wide * scale, loss

        self._args = [*problem.diff, *problem.batch]
        one = jnp.ones([], jnp.float32)
        closed = trace(
            jax.value_and_grad(scaled, has_aux=True), problem.diff, problem.batch, one
        )
        marked = [False] * len(self._args) + [True]
        # The unscaled loss is the second output: its equations are the forward's.
        forward = needed(closed.jaxpr, [False, True] + [False] * len(problem.diff))[0]
        self.ops: list[Op] = []
        self.sites: list[Any] = []  # (equation, calls) of each backward value
        # Each forward value a floating backward op reads: the measured ones it
        # comes from (nearest), by the value's id.
        self.reads: dict[int, tuple[Any, frozenset[int]]] = {}
        self.dtypes: set[str] = set()  # of the floating values computed from the scale
        self.loss_upstream: frozenset[int] = frozenset()
        # An input is its own measured value, read on the host: an inf or NaN in
        # the batch or the parameters is named, not blamed on the op reading it.
        self.inputs_bad = np.array([interpret.nonfinite(a) for a in self._args], bool)
        first = len(self._args)  # the index of the first measured value

        def instrumented(args):
            values, backward = [], []
            # id of a forward value: (the value, kept so that its id stays its
            # own; the indices of the inputs and measured values it comes from)
            lineage = {id(a): (a, frozenset([i])) for i, a in enumerate(args[:first])}

            def upstream_of(value):  # its `lineage` indices (none if not in it)
                return lineage.get(id(value), (None, frozenset()))[1]

            def visit(eqn, inputs, outputs, tags, calls):
                # A value computed from the scale is the backward pass's.
                is_marked = any(tags)
                halves = [v for v in outputs if getattr(v, "dtype", None) == F16]
                if is_marked:
                    self.dtypes.update(
                        np.dtype(v.dtype).name
                        for v in outputs
                        if jnp.issubdtype(getattr(v, "dtype", np.int32), jnp.floating)
                    )
                    if any(interpret.inexact(v) for v in outputs):
                        read(inputs, tags)
                    if not (_moves(eqn) or eqn.primitive.name in _SUMS_OF_TWO):
                        backward.extend(halves)
                        self.sites.extend((eqn, calls) for _ in halves)
                elif id(eqn) in forward:
                    measure(eqn, inputs, outputs, halves, calls)
                return [is_marked] * len(outputs)

            def read(inputs, tags):
                for value, tag in zip(inputs, tags, strict=True):
                    # Traced values: a literal or a constant is no forward value.
                    computed = isinstance(value, jax.Array) and interpret.inexact(value)
                    if not tag and computed and id(value) not in self.reads:
                        self.reads[id(value)] = (value, upstream_of(value))

            def measure(eqn, inputs, outputs, halves, calls):
                upstream = frozenset().union(*map(upstream_of, inputs))
                measured = {}
                # A new magnitude (not a move): measure its float16 outputs.
                if halves and not _moves(eqn):
                    for value in halves:
                        measured[id(value)] = frozenset([first + len(values)])
                        values.append(value)
                    indices = tuple(i for (i,) in measured.values())
                    self.ops.append(Op(eqn, calls, upstream, indices))
                for value in outputs:
                    lineage[id(value)] = (value, measured.get(id(value), upstream))

            outputs, _ = interpret.walk(closed, args, visit, tags=marked)
            self.loss_upstream = upstream_of(outputs[1])
            read_values = [value for value, _ in self.reads.values()]
            return outputs, _peaks(values), _peaks(backward), _peaks(read_values)

        self._compiled = (
            jax.jit(instrumented)
            .lower([*self._args, one])
            .compile(compiler_options={"xla_allow_excess_precision": False})
        )
        self.evaluations: dict[float, Evaluation] = {}

    def __call__(self, scale: float) -> Evaluation:
        """The probe batch at `scale` (each scale is evaluated once)."""
        if scale in self.evaluations:
            return self.evaluations[scale]
        outputs, peaks, backward, reads = jax.device_get(
            self._compiled([*self._args, jnp.asarray(scale, jnp.float32)])
        )
        _, loss, *grads = outputs
        # How many times each backward value fits below the overflow threshold;
        # 0 where it holds an inf or a NaN already.
        with np.errstate(divide="ignore"):
            headroom = np.where(np.isfinite(backward), F16_OVERFLOW / backward, 0)
        reached = np.flatnonzero(headroom <= 1.0)
        first = len(self.inputs_bad)
        bad = np.concatenate([self.inputs_bad, ~np.isfinite(peaks)])
        read_bad = [
            upstream
            for (_, upstream), peak in zip(self.reads.values(), reads, strict=True)
            if not np.isfinite(peak)
        ]
        self.evaluations[scale] = Evaluation(
            scale=scale,
            loss=float(loss),
            grads=grads,
            finite=bool(np.isfinite(loss)) and all(np.isfinite(g).all() for g in grads),
            peaks=np.where(bad, 0, np.concatenate([np.zeros(first), peaks])),
            bad=bad,
            limit=scale * float(np.min(headroom, initial=np.inf)),
            first_overflow=self.sites[reached[0]] if reached.size else None,
            read_bad=frozenset().union(*read_bad),
        )
        return self.evaluations[scale]

    def origins(self, evaluation: Evaluation, values: Any) -> set[int]:
        """Where the infs and NaNs among `values` (indices into `peaks`) come from.

        Followed back through values that are not finite, to an input, or to an
        op whose inputs are all finite (as `interpret.run` blames).
        """
        bad = evaluation.bad
        made_by = {i: op for op in self.ops for i in op.outputs}
        todo, reached = [i for i in values if bad[i]], set()
        while todo:
            i = todo.pop()
            upstream = made_by[i].upstream if i in made_by else ()
            todo += [j for j in upstream if bad[j] and j not in reached]
            reached.add(i)
        return {
            i
            for i in reached
            if i not in made_by or not any(bad[j] for j in made_by[i].upstream)
        }


def needed(jaxpr: Any, outputs: list[bool]) -> tuple[set[int], list[bool]]:
    """The ids of the equations that the flagged outputs of `jaxpr` depend on.

    Inside the calls that `interpret.walk` enters, per output; other equations
    whole. An equation of a sub-jaxpr called twice counts if either call needs it.
    Also returns which of `jaxpr`'s inputs they read.
    """
    found: set[int] = set()
    live = _variables(v for v, f in zip(jaxpr.outvars, outputs, strict=True) if f)
    for eqn in reversed(jaxpr.eqns):
        wanted = [v in live for v in eqn.outvars]
        if not any(wanted):
            continue
        found.add(id(eqn))
        sub = interpret._sub_jaxpr(eqn)
        inputs = eqn.invars
        if sub is not None:
            inner, used = needed(sub.jaxpr, wanted)
            found |= inner
            inputs = [v for v, use in zip(eqn.invars, used, strict=True) if use]
        live |= _variables(inputs)
    return found, [v in live for v in jaxpr.invars]


def _variables(atoms: Any) -> set[Any]:
    """The variables among `atoms` (literals are constants, and not hashable)."""
    return {v for v in atoms if not isinstance(v, core.Literal)}


def _moves(eqn: Any) -> bool:
    """Whether `eqn` only moves values (or casts to a wider range): no new magnitude."""
    if eqn.primitive.name == "convert_element_type":
        before = np.dtype(eqn.invars[0].aval.dtype)
        after = np.dtype(eqn.outvars[0].aval.dtype)
        return (
            jnp.issubdtype(before, jnp.floating)
            and jnp.issubdtype(after, jnp.floating)
            and float(jnp.finfo(after).max) >= float(jnp.finfo(before).max)
        )
    return eqn.primitive.name in _MOVES


def _peaks(values: list[Any]) -> jax.Array:
    """`max |x|` of each float16 value, in float32: inf or NaN where it holds one.

    The NaN comes from an `any`, not from the `max`: of a sharded value, the
    devices' maxima are combined by an all-reduce that drops a NaN on XLA:CPU.
    """
    if not values:
        return jnp.zeros([0], jnp.float32)
    nan = [jnp.full([], jnp.nan, v.dtype) for v in values]
    peaks = [
        jnp.where(jnp.any(jnp.isnan(v)), n, jnp.max(jnp.abs(v), initial=0))
        for v, n in zip(values, nan, strict=True)
    ]
    return jnp.stack(peaks).astype(jnp.float32)
