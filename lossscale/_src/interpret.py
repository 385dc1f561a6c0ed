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
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
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

    def visit(eqn, inputs, outputs, marked, calls):
        if not found and _produced(inputs, outputs):
            found.append(_producer(eqn, calls))

    outputs = walk(closed, args, visit, descend=lambda: not found)
    return outputs, (found[0] if found else None)


def walk(
    closed: Any,
    args: list[Any],
    visit: Callable[[Any, list[Any], list[Any], bool, tuple[Any, ...]], None],
    *,
    marked: Sequence[bool] = (),
    descend: Callable[[], bool] = lambda: True,
    branches: bool = False,
) -> list[Any]:
    """Evaluates `closed` on `args` one equation at a time; returns its outputs.

    Calls `visit(eqn, inputs, outputs, marked, calls)` after each equation it
    binds, eagerly or under a trace (`jax.jit` of a function that calls
    `walk`); `calls` are the call equations it is inside, outermost first. It
    goes inside the calls of `_CALLS` while `descend()` is true. `marked` flags
    some of `args` (e.g. the loss scale): an equation's outputs are marked when
    one of its inputs is, which tells the values computed from them. With
    `branches`, it also goes inside the branch a `cond` takes, when its index is
    concrete (evaluating eagerly).
    """

    def evaluate(jaxpr, consts, values, flags, calls):
        env, marks = {}, {}

        def read(var):
            return var.val if isinstance(var, core.Literal) else env[var]

        def mark(var):
            return False if isinstance(var, core.Literal) else marks[var]

        env.update(zip(jaxpr.constvars, consts, strict=True))
        marks.update((var, False) for var in jaxpr.constvars)
        env.update(zip(jaxpr.invars, values, strict=True))
        marks.update(zip(jaxpr.invars, flags, strict=True))
        for eqn in jaxpr.eqns:
            inputs = [read(var) for var in eqn.invars]
            input_marks = [mark(var) for var in eqn.invars]
            sub = _sub_jaxpr(eqn, len(inputs))
            operands, operand_marks = inputs, input_marks
            if branches and eqn.primitive.name == "cond":
                sub, operands, operand_marks = _branch(eqn, inputs, input_marks)
            if sub is not None and descend():
                outputs, output_marks = evaluate(
                    sub.jaxpr, sub.consts, operands, operand_marks, (*calls, eqn)
                )
            else:
                with eqn.ctx.manager:
                    outputs = eqn.primitive.bind(*inputs, **_bind_params(eqn))
                if not eqn.primitive.multiple_results:
                    outputs = [outputs]
                output_marks = [any(input_marks)] * len(outputs)
                visit(eqn, inputs, outputs, any(input_marks), calls)
            env.update(zip(eqn.outvars, outputs, strict=True))
            marks.update(zip(eqn.outvars, output_marks, strict=True))
        return [read(var) for var in jaxpr.outvars], [
            mark(var) for var in jaxpr.outvars
        ]

    flags = list(marked) + [False] * (len(args) - len(marked))
    outputs, _ = evaluate(closed.jaxpr, closed.consts, args, flags, ())
    return outputs


def _branch(eqn: Any, inputs: list, marks: list) -> tuple[Any, list, list]:
    """The branch a `cond` takes and its operands; `(None, ...)` if traced."""
    index = inputs[0]
    if isinstance(index, jax.core.Tracer):
        return None, inputs, marks
    branches = eqn.params["branches"]
    chosen = branches[int(np.clip(int(index), 0, len(branches) - 1))]
    return chosen, inputs[1:], marks[1:]


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


def _producer(eqn: Any, calls: tuple[Any, ...]) -> Producer:
    place, function = source(eqn, calls=calls)
    return Producer(
        op=eqn.primitive.name,
        backward="transpose" in str(eqn.source_info.name_stack),
        source=place,
        function=function,
    )


# The libraries a model is built with: their frames are not the user's line.
LIBRARIES = ("jax", "jaxlib", "flax", "equinox", "optax", "haiku")


def source(
    eqn: Any, libraries: tuple[str, ...] = LIBRARIES, calls: tuple[Any, ...] = ()
) -> tuple[str | None, str | None]:
    """`("file:line", function)` of the innermost frame outside `libraries`.

    The line of the user's code that called the op (lossscale's own frames and
    the standard library's are skipped too). A traceback inside a jitted
    function starts at its boundary, so an op inside a library's (`jnp.cumsum`)
    has no user frame: then the innermost of the enclosing `calls` that has
    one gives it. `(None, None)` if none does.
    """
    for candidate in (eqn, *reversed(calls)):
        frame = _user_frame(candidate.source_info.traceback, libraries)
        if frame is not None:
            return f"{frame.file_name}:{frame.line_num}", frame.function_name
    return None, None


def _library_dirs(libraries: tuple[str, ...]) -> tuple[str, ...]:
    """Where `libraries` (and lossscale/_src) live: their frames are skipped."""
    dirs = [os.path.dirname(__file__)]  # lossscale/_src, not the user's tests
    for name in libraries:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            dirs.append(os.path.dirname(module.__file__))
    return tuple(os.path.join(d, "") for d in dirs)


def _standard_library(file_name: str) -> bool:
    """Whether a frame is the standard library's (`functools.partial`, ...)."""
    stdlib = os.path.join(os.path.dirname(os.__file__), "")
    return file_name.startswith(stdlib) and "-packages" not in file_name


def _user_frame(traceback: Any, libraries: tuple[str, ...] = LIBRARIES) -> Any:
    """The innermost frame outside `libraries`: the line that called the op."""
    if traceback is None:
        return None
    skip = _library_dirs(libraries)
    for frame in traceback.frames:
        if not frame.file_name.startswith(skip) and not _standard_library(
            frame.file_name
        ):
            return frame
    return None
