"""The forward pass's hazards: float16 sums, overflows and headroom, a 16-bit loss.

The traced program shows the sums that accumulate in float16 and the dtype the
loss is computed in; the probe (`probe.Probe`: the forward pass on the probe
batch, every value rounded to its dtype as the program says) shows the ops whose
float16 outputs are not finite or are near float16's largest value.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from jax.extend import core

from lossscale._src.diagnostics.engine import interpret
from lossscale._src.diagnostics.engine.probe import F16
from lossscale._src.diagnostics.engine.probe import Evaluation
from lossscale._src.diagnostics.engine.probe import Probe
from lossscale._src.diagnostics.engine.program import Program
from lossscale._src.diagnostics.engine.program import trace
from lossscale._src.diagnostics.findings import Finding
from lossscale._src.diagnostics.findings import listed

F16_MAX = float(np.finfo(np.float16).max)
# More than this many float16 values summed in float16. Summing n values one by
# one rounds n - 1 times: the error bound is (n - 1) * 2**-11 of the sum, 1/8 at 256.
ACCUMULATION_LIMIT = 256
# An output within 8x of 65504 overflows after three doublings (a residual sum,
# a larger batch, a later step).
HEADROOM = 8.0
# Sums whose accumulator is the input's dtype, and how many values go into one
# output. `jnp.sum`, `jnp.mean`, `jnp.var`, `jax.nn.softmax` and
# `jax.nn.logsumexp` cast float16 to float32 first, and XLA accumulates float16
# dots in float32 (on CPU and GPU), so they are not listed.
_SUMS = {
    "reduce_sum": lambda shape, p: math.prod(shape[a] for a in p["axes"]),
    "cumsum": lambda shape, p: shape[p["axis"]],
    "cumlogsumexp": lambda shape, p: shape[p["axis"]],
    "reduce_window_sum": lambda shape, p: math.prod(p["window_dimensions"]),
}


def check(problem: Program, probe: Probe, evaluation: Evaluation) -> list[Finding]:
    """The forward pass's findings: the traced program's and the probe batch's."""
    closed = trace(lambda d, b: problem.loss(d, b)[0], problem.diff, problem.batch)
    findings = half_accumulations(closed.jaxpr)
    findings += loss_in_half(closed.jaxpr)
    return findings + _overflows(problem, probe, evaluation)


# -- the traced program ----------------------------------------------------------


def half_accumulations(jaxpr: Any) -> list[Finding]:
    """A warning per line of user code that sums > 256 float16 values in float16."""
    found: dict[str | None, list[str]] = {}
    for eqn, calls in _equations(jaxpr, ()):
        count = _SUMS.get(eqn.primitive.name)
        if count is None or eqn.invars[0].aval.dtype != F16:
            continue
        n = count(eqn.invars[0].aval.shape, eqn.params)
        if n > ACCUMULATION_LIMIT:
            what = f"`{eqn.primitive.name}` of {n} values"
            found.setdefault(interpret.source(eqn, calls=calls)[0], []).append(what)
    return [
        Finding(
            code="half-accumulation",
            severity="warning",
            message=(
                f"{listed(sums)} accumulates in float16: each output adds up more"
                f" than {ACCUMULATION_LIMIT} float16 values in float16, and the"
                " rounding error grows with their number."
            ),
            where=where,
            fix=(
                "Accumulate in float32: cast the input first and the result back"
                " (`jnp.cumsum(x.astype(jnp.float32), axis).astype(x.dtype)`), or"
                " use `jnp.sum`/`jnp.mean`, which do so for float16."
            ),
        )
        for where, sums in found.items()
    ]


def loss_in_half(jaxpr: Any) -> list[Finding]:
    """A warning if the loss is computed in a 16-bit dtype (widened after or not)."""
    var, eqn, top = jaxpr.outvars[0], None, jaxpr
    calls: tuple[Any, ...] = ()
    while True:
        eqn = None
        if not isinstance(var, core.Literal):  # literals are no equation's output
            eqn = next((e for e in jaxpr.eqns if var in e.outvars), None)
        if eqn is None:
            break
        sub = interpret._sub_jaxpr(eqn)
        if sub is not None:  # a call: follow the output into its jaxpr
            jaxpr, var = sub.jaxpr, sub.jaxpr.outvars[eqn.outvars.index(var)]
            calls = (*calls, eqn)
        elif eqn.primitive.name == "convert_element_type" and _widens(eqn):
            var = eqn.invars[0]
        else:
            break
    dtype = np.dtype(var.aval.dtype)
    if isinstance(var, core.Literal) or dtype.itemsize != 2:
        return []
    widened = dtype != np.dtype(top.outvars[0].aval.dtype)
    return [
        Finding(
            code="loss-in-half",
            severity="warning",
            message=(
                f"The loss is computed in {dtype.name}"
                + (" (and cast to a wider dtype after)" if widened else "")
                + f": its sums and logarithms carry {dtype.name}'s rounding, and"
                " a large loss overflows."
            ),
            where=None if eqn is None else interpret.source(eqn, calls=calls)[0],
            fix=(
                "Compute the loss in float32: cast the logits or predictions first"
                " (`logits.astype(jnp.float32)`), as in"
                " `optax.softmax_cross_entropy_with_integer_labels(logits.astype("
                "jnp.float32), labels).mean()`."
            ),
        )
    ]


def _widens(eqn: Any) -> bool:
    before = np.dtype(eqn.invars[0].aval.dtype)
    after = np.dtype(eqn.outvars[0].aval.dtype)
    return np.issubdtype(before, np.floating) and after.itemsize > before.itemsize


def _equations(jaxpr: Any, calls: tuple[Any, ...]):
    """`(equation, enclosing equations)` of `jaxpr` and the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        yield eqn, calls
        for sub in _jaxprs_in(eqn.params):
            yield from _equations(sub, (*calls, eqn))


def _jaxprs_in(params: dict) -> Any:
    """The jaxprs among an equation's parameters (`core.jaxprs_in_params`, jax 0.7+)."""
    for value in params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if isinstance(item, core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, core.Jaxpr):
                yield item


# -- the probe batch ------------------------------------------------------------


def _overflows(problem: Program, probe: Probe, evaluation: Evaluation) -> list[Finding]:
    """Where the loss's inf or NaN comes from; values near float16's largest."""
    peaks, bads = evaluation.peaks, evaluation.bad
    # The values (inputs, or ops' outputs) the loss's inf or NaN comes from. An inf
    # that the loss does not keep, such as a `-inf` attention mask that the softmax
    # turns into zeros, is not blamed (`Probe.origins`).
    origins: set[int] = set()
    if not np.isfinite(evaluation.loss):
        origins = probe.origins(evaluation, probe.loss_upstream)
    overflows: dict[str | None, list[str]] = {}
    close: dict[str | None, list[str]] = {}
    for op in probe.ops:
        largest_input = max((float(peaks[i]) for i in op.upstream), default=0.0)
        name = f"`{op.eqn.primitive.name}`"
        where = interpret.source(op.eqn, calls=op.calls)[0]
        if origins.intersection(op.outputs):
            overflows.setdefault(where, []).append(
                f"{name} (from float16 values up to {largest_input:.4g})"
                if largest_input
                else name
            )
        if interpret.constant_input(op.eqn, op.calls) is not None:
            continue  # a constant (a mask's) does not grow with the batch
        for i in op.outputs:
            peak = float(peaks[i])
            if not bads[i] and peak >= F16_MAX / HEADROOM and peak > largest_input:
                close.setdefault(where, []).append(f"{name} ({peak:.4g})")
    findings = []
    inputs = problem.input_names()
    names = [inputs[i] for i in sorted(origins) if i < len(inputs)]
    if names:
        findings.append(
            Finding(
                code="forward-overflow",
                severity="error",
                message=(
                    f"The input is not finite: {listed([f'`{n}`' for n in names])}"
                    " holds an inf or a NaN before any op runs, and the loss is"
                    f" {evaluation.loss:g}. No loss scale or float32 cast fixes that."
                ),
                where=names[0],
                fix=(
                    "Clean the data (or the parameters) it comes from, or skip such"
                    " batches: with `value=loss` the step skips them without backing"
                    " off the scale."
                ),
            )
        )
    findings += [
        Finding(
            code="forward-overflow",
            severity="error",
            message=(
                f"{listed(ops)} gives inf or NaN in float16 on the probe batch,"
                f" from finite inputs, and the loss is {evaluation.loss:g}. No loss"
                " scale fixes a forward overflow."
            ),
            where=where,
            fix=(
                "Compute that op in float32 (cast its input with"
                " `.astype(jnp.float32)`), or keep its input in float16's range"
                " (subtract the max before `exp`, as `jax.nn.softmax` does; divide"
                " attention scores by sqrt(head dim))."
            ),
        )
        for where, ops in overflows.items()
    ]
    findings += [
        Finding(
            code="forward-headroom",
            severity="warning",
            message=(
                f"{listed(ops)}: its float16 output on the probe batch is within"
                f" {HEADROOM:g}x of float16's largest value, {F16_MAX:g}; a larger"
                " input or a later step overflows."
            ),
            where=where,
            fix=(
                "Compute it in float32, or rescale it: a mean instead of a sum, a"
                " normalisation before it, smaller inputs."
            ),
        )
        for where, ops in close.items()
        if where not in overflows
    ]
    return findings
