"""Diagnostics: what in a float16 program fails, and where a step overflowed.

Before the first step, `preflight` reads a loss function's program and says which
operations will overflow or underflow in float16 and what to change;
`preflight_step` runs a whole train step at two scales and checks that it is
loss-scaled correctly. After a skipped step, `locate_overflow` finds the first
operation that made an inf or NaN, and `leaf_path` names the parameter a state's
`overflow_leaf` points at. `grad_stats` gives per-leaf gradient statistics to log.
Guide: `docs/guides/diagnostics.md`.
"""

from lossscale._src.api.leaf_path import leaf_path
from lossscale._src.api.metrics import grad_stats
from lossscale._src.diagnostics.findings import Finding
from lossscale._src.diagnostics.findings import PreflightReport
from lossscale._src.diagnostics.locate import OverflowReport
from lossscale._src.diagnostics.locate import locate_overflow
from lossscale._src.diagnostics.preflight import preflight
from lossscale._src.diagnostics.step_check import preflight_step

__all__ = (
    "Finding",
    "OverflowReport",
    "PreflightReport",
    "grad_stats",
    "leaf_path",
    "locate_overflow",
    "preflight",
    "preflight_step",
)
