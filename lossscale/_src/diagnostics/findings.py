"""What `preflight` and `preflight_step` report: findings, and the table they print."""

from __future__ import annotations

import collections
import dataclasses
import math
import textwrap
from collections.abc import Sequence

SEVERITIES = ("error", "warning", "info")
_WIDTH = 88


@dataclasses.dataclass(frozen=True)
class Finding:
    """One hazard that `lossscale.diagnostics.preflight` found, and what to change.

    Attributes:
      code: what was found, one of the codes of the preflight guide
        (`docs/guides/preflight.md`), e.g. `"forward-overflow"`.
      severity: `"error"` (training will fail), `"warning"` (it will lose
        batches or precision) or `"info"` (something unneeded).
      message: what was found, with the numbers measured on the probe batch.
      where: `"file:line"` of the user's code that calls the op, the path of a
        gradient or parameter leaf (`jax.tree_util.keystr`), the input that is
        not finite (`loss_fn`'s argument and path: `"batch['image']"`), or None.
      fix: what to change, concretely.

    Examples:
      >>> import lossscale
      >>> finding = lossscale.diagnostics.Finding(
      ...     code="loss-in-half", severity="warning", message="The loss is float16.",
      ...     where="train.py:12", fix="Cast the logits to float32.")
      >>> print(finding)
      warning loss-in-half at train.py:12: The loss is float16. Cast the logits to
      float32.
    """

    code: str
    severity: str
    message: str
    where: str | None
    fix: str

    def __post_init__(self):
        if self.severity not in SEVERITIES:
            raise ValueError(
                f"`severity` must be one of {SEVERITIES}, got {self.severity!r}."
            )

    def __str__(self) -> str:
        place = f" at {self.where}" if self.where else ""
        return textwrap.fill(
            f"{self.severity} {self.code}{place}: {self.message} {self.fix}", _WIDTH
        )


@dataclasses.dataclass(frozen=True)
class PreflightReport:
    """What `lossscale.diagnostics.preflight` or `preflight_step` found.

    Attributes:
      findings: the findings (each a `Finding`), errors first, then warnings,
        then info.
      scale: the largest power of two (at most `2**24`) at which the probe's
        scaled gradients stay finite with a 2x margin: the highest a dynamic
        scale can start without losing a batch to a back-off. Start at
        lossscale's default (2**15) unless it is lower, or a
        `gradient-underflow` finding says to start there
        (`docs/guides/preflight.md`, measured). None where it was not probed
        (`preflight_step`) or no scale gives finite gradients.
      notes: what was probed, and what was not (e.g. no `optimizer` given).

    Examples:
      >>> import lossscale
      >>> report = lossscale.diagnostics.PreflightReport(findings=(), scale=2.0**17)
      >>> print(report.codes, report.scale)
      frozenset() 131072.0
      >>> print(report)
      preflight: no errors, no warnings. A dynamic scale can start up to 2**17
      (report.scale).
    """

    findings: tuple[Finding, ...]
    scale: float | None
    notes: tuple[str, ...] = ()

    @property
    def codes(self) -> frozenset[str]:
        """The set of the findings' codes."""
        return frozenset(finding.code for finding in self.findings)

    def __str__(self) -> str:
        counts = collections.Counter(f.severity for f in self.findings)
        head = [_count(counts["error"], "error"), _count(counts["warning"], "warning")]
        if counts["info"]:
            head.append(_count(counts["info"], "note"))
        title = "preflight: " + ", ".join(head) + "."
        if self.scale is not None:
            title += (
                f" A dynamic scale can start up to {power(self.scale)} (report.scale)."
            )
        lines = [title]
        if self.findings:
            code = max(len(f.code) for f in self.findings)
            lines += ["", f"{'severity':8s}  {'code':{code}s}  where"]
            for f in self.findings:
                lines.append(f"{f.severity:8s}  {f.code:{code}s}  {f.where or '-'}")
                for label, text in (("", f.message), ("fix: ", f.fix)):
                    lines += textwrap.wrap(
                        label + text,
                        _WIDTH,
                        initial_indent="    ",
                        subsequent_indent="    ",
                    )
        lines += [textwrap.fill(note, _WIDTH) for note in self.notes]
        return "\n".join(lines)


def _count(number: int, noun: str) -> str:
    if number == 0:
        return f"no {noun}s"
    return f"{number} {noun}{'s' if number > 1 else ''}"


def power(scale: float) -> str:
    """`2**k` for a power of two, else the number (`%g`)."""
    exponent = math.log2(scale) if scale > 0 else 0.5
    if exponent == int(exponent):
        return f"2**{int(exponent)}"
    return f"{scale:g}"


def literal(scale: float) -> str:
    """`scale` as Python code: `2.0**k` for a power of two, else its repr."""
    text = power(scale)
    return text.replace("2**", "2.0**") if text.startswith("2**") else repr(scale)


def ordered(findings: list[Finding]) -> tuple[Finding, ...]:
    """Errors first, then warnings, then info; in the order found within each."""
    return tuple(sorted(findings, key=lambda f: SEVERITIES.index(f.severity)))


def listed(items: Sequence[str]) -> str:
    """The first three distinct `items`, and how many more."""
    unique = list(dict.fromkeys(items))
    text = ", ".join(unique[:3])
    return text + (f" and {len(unique) - 3} more" if len(unique) > 3 else "")
