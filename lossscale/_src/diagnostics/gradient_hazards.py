"""The gradients' hazards, from the probe batch's scaled gradients at a few scales.

The probe (`probe.Probe`) measures how far each float16 value of the backward
pass is from overflowing. The backward pass is linear in the scale, so from one
finite evaluation follows the scale at which the first float16 value overflows;
evaluations at twice and four times the candidate confirm it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from lossscale._src.diagnostics.engine import interpret
from lossscale._src.diagnostics.engine.probe import F16_OVERFLOW
from lossscale._src.diagnostics.engine.probe import Evaluation
from lossscale._src.diagnostics.engine.probe import Probe
from lossscale._src.diagnostics.engine.program import Program
from lossscale._src.diagnostics.findings import Finding
from lossscale._src.diagnostics.findings import literal
from lossscale._src.diagnostics.findings import power
from lossscale._src.state.kind import LossScale
from lossscale._src.state.kinds import NoOpLossScale

MAX_SCALE = 2.0**24
# More than 1% of the nonzero gradient values lost to zero is reported.
UNDERFLOW_LIMIT = 0.01
# Scales tried, from the top, when the starting scale overflows.
_FALLBACKS = (2.0**8, 1.0, 2.0**-8, 2.0**-16, 2.0**-24)


@dataclasses.dataclass(frozen=True)
class Gradients:
    """What the gradient probe found, and what the optimizer probe needs."""

    findings: list[Finding]
    scale: float | None  # `PreflightReport.scale`
    reference: list[np.ndarray] | None  # unscaled float32 gradients, best scale
    note: str


def check(problem: Program, probe: Probe, start: LossScale) -> Gradients:
    """Evaluates the gradients at the start and around the largest safe scale."""
    first = probe(float(start.scale))
    # `map` is lazy: the fallbacks are evaluated only until one is finite.
    scales = [first.scale] + [s for s in _FALLBACKS if s < first.scale]
    base = next((e for e in map(probe, scales) if e.finite), None)
    scale = None if base is None else _largest_safe_scale(probe, base)
    finite = [e for e in probe.evaluations.values() if e.finite]
    best = max(finite, key=lambda e: e.scale, default=None)
    reference = None
    if best is not None:
        reference = [np.asarray(g, np.float32) / best.scale for g in best.grads]
    findings = _overflow(probe, first, scale)
    if first.finite and best is not None and best.scale > first.scale:
        findings += _underflow(problem, probe, first, best, start, scale)
    tried = ", ".join(power(s) for s in sorted(probe.evaluations))
    if "float16" not in probe.dtypes and "bfloat16" in probe.dtypes:
        if start.min_scale < start.max_scale:
            findings.append(_bfloat16_dynamic(start))
    return Gradients(findings, scale, reference, f"Gradients probed at scales {tried}.")


def _largest_safe_scale(probe: Probe, base: Evaluation) -> float | None:
    """The largest power of two <= 2**24 whose double gives finite gradients."""
    # 2 * scale must stay below the estimated limit: scale < limit / 2.
    exponent = math.ceil(math.log2(base.limit / 2)) - 1 if base.limit < 2**126 else 24
    scale = 2.0 ** min(exponent, 24)
    while not probe(2 * scale).finite:
        scale /= 2
        if scale < 2.0**-24:
            return None
    # The estimate counts the backward pass's float16 values, even one that
    # a mask drops before the gradients: try one doubling more.
    if scale < MAX_SCALE and probe(4 * scale).finite:
        scale *= 2
    return scale


def _overflow(probe: Probe, first: Evaluation, scale: float | None) -> list[Finding]:
    if first.finite or not np.isfinite(first.loss):
        return []
    if scale is None:
        return [_unfixable(probe)]
    where, op = None, "a float16 op"
    if first.first_overflow is not None:
        eqn, calls = first.first_overflow
        where, op = interpret.source(eqn, calls=calls)[0], f"`{eqn.primitive.name}`"
    advice = (
        f"Start the scale at {power(scale)} (`report.scale`), the largest with"
        " finite gradients at twice it: e.g."
        f" `lossscale.DynamicLossScale(scale={literal(scale)})`."
    )
    return [
        Finding(
            code="gradient-overflow",
            severity="warning",
            message=(
                f"The scaled gradients are not finite at the starting scale"
                f" {power(first.scale)} ({op} overflows float16 in the backward"
                " pass): a dynamic scale skips batches while it backs off, a"
                " static one skips every batch."
            ),
            where=where,
            fix=advice,
        )
    ]


def _unfixable(probe: Probe) -> Finding:
    """No scale gives finite gradients: the first inf or NaN, and what to do.

    It is scale-free: made in the forward pass (a value the loss drops and its
    gradient does not, such as a -inf attention mask over a row with no key
    left), or by a backward op at every scale.
    """
    lowest = probe(min(probe.evaluations))
    # A forward inf or NaN is to blame if the backward pass reads it; one the
    # backward pass does not read (a -inf padding before a max) is not.
    sources = probe.origins(lowest, lowest.read_bad)
    origin = _forward_origin(probe, lowest, sources) if sources else None
    if origin is not None:
        eqn, calls = origin
        made = (
            f"`{eqn.primitive.name}` makes the first inf or NaN, in the forward pass"
            f" from finite inputs{_constant(eqn, calls)}: the loss drops it, and its"
            " gradient does not (0 * inf is NaN)"
        )
        fix = (
            "Keep that value within float16's range: a mask constant of"
            " `jnp.finfo(jnp.float16).min` (-65504), not -inf or -1e30, which float16"
            " rounds to -inf; or compute that op in float32."
        )
    else:
        eqn, calls = lowest.first_overflow or (None, ())
        name = f"`{eqn.primitive.name}`" if eqn is not None else "a float16 op"
        made = f"{name} overflows float16 in the backward pass at every scale"
        fix = "Compute that op in float32."
    return Finding(
        code="gradient-overflow",
        severity="error",
        message=(
            f"No loss scale gives finite gradients: they are not finite at every"
            f" scale tried, down to {power(lowest.scale)}. {made}."
        ),
        where=interpret.source(eqn, calls=calls)[0] if eqn is not None else None,
        fix=fix,
    )


def _forward_origin(
    probe: Probe, evaluation: Evaluation, among: set[int]
) -> tuple[Any, Any] | None:
    """The first forward op, in program order, that makes an inf or NaN from none.

    The first whose outputs are among the values `among`.
    """
    bad = evaluation.bad
    for op in probe.ops:
        outputs = [i for i in op.outputs if i in among]
        if any(bad[i] for i in outputs) and not any(bad[i] for i in op.upstream):
            return op.eqn, op.calls
    return None


def _constant(eqn: Any, calls: tuple[Any, ...]) -> str:
    """`" (the constant c, -inf in float16)"` if `eqn` casts one float16 cannot hold."""
    value = interpret.constant_input(eqn, calls)
    if eqn.primitive.name != "convert_element_type" or value is None:
        return ""
    if np.ndim(value) or not np.isfinite(value) or abs(value) < F16_OVERFLOW:
        return ""
    sign = "-" if value < 0 else ""
    return f" (the constant {float(value):.8g}, {sign}inf in float16)"


def _underflow(
    problem: Program,
    probe: Probe,
    first: Evaluation,
    best: Evaluation,
    start: LossScale,
    scale: float | None,
) -> list[Finding]:
    lost = _lost(first, best)
    nonzero = max(sum(np.count_nonzero(g) for g in best.grads), 1)
    share = sum(lost) / nonzero
    if share <= UNDERFLOW_LIMIT:
        return []
    target = scale or best.scale
    where = problem.diff_paths[int(np.argmax(lost))]
    most = f"the most in {where}" if where else "in the one parameter array"
    measured = (
        f"{share:.1%} of the nonzero gradient values (at {power(best.scale)}, the"
        f" largest scale probed with finite gradients) are zero at"
        f" {power(first.scale)}"
    )
    named = f"{power(target)} (`report.scale`)" if scale else power(target)
    if isinstance(start, NoOpLossScale):
        if "float16" not in probe.dtypes:
            return []
        return [
            Finding(
                code="unscaled-half-gradients",
                severity="error",
                message=(
                    f"The backward pass runs in float16 without loss scaling:"
                    f" {measured}, {most}. The parameters whose gradients"
                    " are all zero do not train."
                ),
                where=where,
                fix=(
                    f"Scale the loss, starting at {named}: `lossscale.wrap(inner,"
                    " loss_scale=lossscale.DynamicLossScale(scale="
                    f"{literal(target)}))`."
                ),
            )
        ]
    # Of the values lost, those still zero at the scale the fix names.
    still = sum(_lost(probe(target), best)) / nonzero
    start_at = f"`lossscale.DynamicLossScale(scale={literal(target)})`"
    return [
        Finding(
            code="gradient-underflow",
            severity="warning",
            message=f"{measured}, {most}.",
            where=where,
            fix=(
                f"Start the scale at {named}: {start_at}. There {still:.1%} of the"
                " nonzero values are still zero (kept only above it, at"
                f" {power(best.scale)})."
                if still
                else f"Start the scale at {named}, which keeps them: {start_at}."
            ),
        )
    ]


def _lost(evaluation: Evaluation, best: Evaluation) -> list[int]:
    """Per gradient leaf, how many values are nonzero at `best`, zero here."""
    return [
        int(np.sum((np.asarray(ours) == 0) & (np.asarray(theirs) != 0)))
        for ours, theirs in zip(evaluation.grads, best.grads, strict=True)
    ]


def _bfloat16_dynamic(start: LossScale) -> Finding:
    return Finding(
        code="bfloat16-dynamic-scale",
        severity="info",
        message=(
            f"The backward pass runs in bfloat16 with a {type(start).__name__}:"
            " bfloat16 has float32's range, so its gradients neither underflow nor"
            " overflow where float16's do, and the scale only adds work."
        ),
        where=None,
        fix=(
            "Use no loss scale: `lossscale.wrap(inner, None)` (a"
            " `NoOpLossScale`), which still skips non-finite steps."
        ),
    )
