"""Running a jaxpr one equation at a time, to find the first that overflows.

`jax.experimental.checkify`'s float checks flag NaNs and divisions by zero, not
infs, and an overflow is an inf before it is a NaN (`jnp.exp` of float16 20.0
passes them; docs/design.md, "Locating an overflow"). So `locate_overflow`
evaluates the jaxpr of the scaled loss's `value_and_grad` equation by
equation, as `jax.core.eval_jaxpr` does, and follows each inf or NaN back to
the equation, or the input, it came from (`run`). `preflight` walks the same
way (`walk`), measuring values instead.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
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
    "remat2": "jaxpr",  # `jax.checkpoint`'s primitive
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
}


@dataclasses.dataclass(frozen=True)
class Producer:
    """An equation whose inputs held no inf or NaN that reaches its output."""

    op: str
    backward: bool
    source: str | None
    function: str | None


@dataclasses.dataclass(frozen=True)
class Run:
    """What `run` found: the outputs, and where each one's inf or NaN came from.

    `origins[i]` is None for a finite output; otherwise an index into `sources`,
    whose entries are in the order they were found: an int is the position of
    an argument that was not finite on entry, a `Producer` the equation that
    made the first non-finite value this output derives from.
    """

    outputs: list[Any]
    origins: list[int | None]
    sources: list[int | Producer]


def run(closed: Any, args: list[Any]) -> Run:
    """Evaluates `closed` (a ClosedJaxpr) on `args`, as `jax.core.eval_jaxpr`.

    Each value carries the origin of its inf or NaN. An equation whose output
    is not finite passes on the earliest origin among its inputs'; if none of
    its inputs has one, it is the origin. So a non-finite value that never
    reaches an output (an aux metric's `log(0)`) is never blamed for one that
    does, and a constant `-inf` (an attention mask) is blamed only through the
    equation that carries it into a non-finite result.
    """
    sources: list[int | Producer] = []

    def new_source(source: int | Producer) -> int:
        sources.append(source)
        return len(sources) - 1

    def visit(eqn, inputs, outputs, in_origins, calls):
        return _origins(outputs, in_origins, lambda: new_source(_producer(eqn, calls)))

    origins = [
        new_source(position) if nonfinite(arg) else None
        for position, arg in enumerate(args)
    ]
    outputs, out_origins = walk(closed, list(args), visit, tags=origins)
    return Run(outputs, out_origins, sources)


def walk(
    closed: Any,
    args: list[Any],
    visit: Callable[[Any, list[Any], list[Any], list[Any], tuple[Any, ...]], Any],
    *,
    tags: Sequence[Any] = (),
    descend: Callable[[], bool] = lambda: True,
    branches: bool = False,
) -> tuple[list[Any], list[Any]]:
    """Evaluates `closed` on `args` one equation at a time.

    Calls `visit(eqn, inputs, outputs, input_tags, calls)` after each equation
    it binds, eagerly or under a trace (`jax.jit` of a function that calls
    `walk`); `calls` are the call equations it is inside, outermost first.
    Every value carries a tag: `tags` are the first of `args`' (the rest, the
    constants and literals have None), and `visit` returns its outputs' (a
    list; None for all None). So a tag follows values through the calls it
    goes inside, those of `_CALLS` while `descend()` is true. With `branches`,
    it also goes inside the branch a `cond` takes, when its index is concrete
    (evaluating eagerly). Returns the outputs and their tags.
    """

    def evaluate(jaxpr, consts, values, in_tags, calls):
        env = {}

        def read(var):
            return (var.val, None) if isinstance(var, core.Literal) else env[var]

        env.update(zip(jaxpr.constvars, [(c, None) for c in consts], strict=True))
        env.update(zip(jaxpr.invars, zip(values, in_tags, strict=True), strict=True))
        for eqn in jaxpr.eqns:
            pairs = [read(var) for var in eqn.invars]
            inputs = [value for value, _ in pairs]
            input_tags = [tag for _, tag in pairs]
            sub = _sub_jaxpr(eqn, len(inputs))
            operands, operand_tags = inputs, input_tags
            if branches and eqn.primitive.name == "cond":
                sub, operands, operand_tags = _branch(eqn, inputs, input_tags)
            if sub is not None and descend():
                outputs, output_tags = evaluate(
                    sub.jaxpr, sub.consts, operands, operand_tags, (*calls, eqn)
                )
            else:
                with eqn.ctx.manager:
                    outputs = eqn.primitive.bind(*inputs, **_bind_params(eqn))
                if not eqn.primitive.multiple_results:
                    outputs = [outputs]
                output_tags = visit(eqn, inputs, outputs, input_tags, calls)
                if output_tags is None:
                    output_tags = [None] * len(outputs)
            pairs = zip(outputs, output_tags, strict=True)
            env.update(zip(eqn.outvars, pairs, strict=True))
        pairs = [read(var) for var in jaxpr.outvars]
        return [value for value, _ in pairs], [tag for _, tag in pairs]

    padded = list(tags) + [None] * (len(args) - len(tags))
    return evaluate(closed.jaxpr, closed.consts, list(args), padded, ())


def _branch(eqn: Any, inputs: list, tags: list) -> tuple[Any, list, list]:
    """The branch a `cond` takes and its operands; `(None, ...)` if traced."""
    index = inputs[0]
    if isinstance(index, jax.core.Tracer):
        return None, inputs, tags
    branches = eqn.params["branches"]
    chosen = branches[int(np.clip(int(index), 0, len(branches) - 1))]
    return chosen, inputs[1:], tags[1:]


def _origins(
    outputs: list[Any], in_origins: list[int | None], made_here: Callable[[], int]
) -> list[int | None]:
    """Each output's origin: None if finite, else the inputs' earliest, else here."""
    inherited = min((o for o in in_origins if o is not None), default=None)
    origins: list[int | None] = []
    here = None
    for output in outputs:
        if not nonfinite(output):
            origins.append(None)
        elif inherited is not None:
            origins.append(inherited)
        else:
            here = made_here() if here is None else here
            origins.append(here)
    return origins


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
    """Whether a floating-point array holds an inf or a NaN (others: False).

    `jnp.issubdtype`, not NumPy's: a typed PRNG key's dtype (`key<fry>`) is not
    a NumPy dtype, and a key is held fixed like an integer.
    """
    dtype = getattr(value, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
        return False
    return not bool(np.isfinite(np.asarray(value)).all())


def _produced(inputs: list[Any], outputs: list[Any]) -> bool:
    return any(nonfinite(x) for x in outputs) and not any(nonfinite(x) for x in inputs)


def _transposed(eqn: Any) -> bool:
    """Whether `eqn` was made by transposing (the backward pass of `grad`).

    Read from the name stack's transforms, not its text: a `named_scope` (or a
    Flax module) named "transpose" is a scope of the forward pass.
    """
    stack = getattr(eqn.source_info.name_stack, "stack", ())
    return any(
        type(entry).__name__ == "Transform" and entry.name == "transpose"
        for entry in stack
    )


def _producer(eqn: Any, calls: tuple[Any, ...]) -> Producer:
    place, function = source(eqn, calls=calls)
    return Producer(
        op=eqn.primitive.name,
        # Inside a transposed call every equation is in the backward pass,
        # though its own name stack starts afresh.
        backward=any(_transposed(e) for e in (*calls, eqn)),
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
