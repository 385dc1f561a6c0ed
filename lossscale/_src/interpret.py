"""Running a jaxpr one equation at a time, to find the first that overflows.

`jax.experimental.checkify`'s float checks flag NaNs and divisions by zero, not
infs, and an overflow is an inf before it is a NaN (`jnp.exp` of float16 20.0
passes them; docs/design.md, "Locating an overflow"). So `locate_overflow`
evaluates the jaxpr of the scaled loss's `value_and_grad` equation by
equation, as `jax.core.eval_jaxpr` does, and checks what each produces.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import numpy as np
from jax.extend import core

# Primitives whose inputs and outputs are their sub-jaxpr's, one to one: the walk
# goes inside them (the user's own `jax.jit`, `jax.checkpoint`, custom rules).
# Others (`cond`, `scan`, `while`) run whole and are named as the op.
_CALLS = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
}


@dataclasses.dataclass(frozen=True)
class Producer:
    """The first equation whose finite inputs gave a non-finite output."""

    op: str
    backward: bool
    source: str | None
    function: str | None


def run(closed: Any, args: list[Any]) -> tuple[list[Any], Producer | None]:
    """Evaluates `closed` (a ClosedJaxpr) on `args`, as `jax.core.eval_jaxpr`.

    Returns its outputs, and the first equation that produced a non-finite
    value from finite inputs (None if none did).
    """
    found: list[Producer] = []

    def evaluate(jaxpr, consts, values):
        env = {}

        def read(var):
            return var.val if isinstance(var, core.Literal) else env[var]

        env.update(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, values, strict=True))
        for eqn in jaxpr.eqns:
            inputs = [read(var) for var in eqn.invars]
            sub = _sub_jaxpr(eqn, len(inputs))
            if sub is not None and not found:
                outputs = evaluate(sub.jaxpr, sub.consts, inputs)
            else:
                with eqn.ctx.manager:
                    outputs = eqn.primitive.bind(*inputs, **_bind_params(eqn))
                if not eqn.primitive.multiple_results:
                    outputs = [outputs]
                if not found and _produced(inputs, outputs):
                    found.append(_producer(eqn))
            env.update(zip(eqn.outvars, outputs, strict=True))
        return [read(var) for var in jaxpr.outvars]

    outputs = evaluate(closed.jaxpr, closed.consts, args)
    return outputs, (found[0] if found else None)


def _bind_params(eqn: Any) -> dict[str, Any]:
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # JAX before 0.7 returned (subfuns, params)
        subfuns, params = params
        if subfuns:
            raise NotImplementedError(f"`{eqn.primitive.name}` with subfunctions")
    return params


def _sub_jaxpr(eqn: Any, arity: int) -> Any:
    key = _CALLS.get(eqn.primitive.name)
    sub = eqn.params.get(key) if key else None
    if isinstance(sub, core.Jaxpr):
        sub = core.ClosedJaxpr(sub, ())
    if not isinstance(sub, core.ClosedJaxpr):
        return None
    if len(sub.jaxpr.invars) != arity or len(sub.jaxpr.outvars) != len(eqn.outvars):
        return None
    return sub


def nonfinite(value: Any) -> bool:
    """Whether a floating-point array holds an inf or a NaN (others: False)."""
    dtype = getattr(value, "dtype", None)
    if dtype is None or not np.issubdtype(np.dtype(dtype), np.inexact):
        return False
    return not bool(np.isfinite(np.asarray(value)).all())


def _produced(inputs: list[Any], outputs: list[Any]) -> bool:
    return any(nonfinite(x) for x in outputs) and not any(nonfinite(x) for x in inputs)


def _producer(eqn: Any) -> Producer:
    frame = _user_frame(eqn.source_info.traceback)
    return Producer(
        op=eqn.primitive.name,
        backward="transpose" in str(eqn.source_info.name_stack),
        source=None if frame is None else f"{frame.file_name}:{frame.line_num}",
        function=None if frame is None else frame.function_name,
    )


def _library_dirs() -> tuple[str, ...]:
    """Where the libraries a model is built with live: their frames are skipped."""
    dirs = [os.path.dirname(__file__)]  # lossscale/_src, not the user's tests
    for name in ("jax", "jaxlib", "flax", "equinox", "optax", "haiku"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            dirs.append(os.path.dirname(module.__file__))
    return tuple(os.path.join(d, "") for d in dirs)


def _standard_library(file_name: str) -> bool:
    """Whether a frame is the standard library's (`functools.partial`, ...)."""
    stdlib = os.path.join(os.path.dirname(os.__file__), "")
    return file_name.startswith(stdlib) and "-packages" not in file_name


def _user_frame(traceback: Any) -> Any:
    """The innermost frame of the user's code: the line that called the op."""
    if traceback is None:
        return None
    skip = _library_dirs()
    for frame in traceback.frames:
        if not frame.file_name.startswith(skip) and not _standard_library(
            frame.file_name
        ):
            return frame
    return None
