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

from lossscale import _src

# Primitives whose inputs and outputs are their sub-jaxpr's, one to one: the walk
# goes inside them (the user's own `jax.jit`, `jax.checkpoint`, custom rules).
# Others (`cond`, `scan`, `while`) run whole and are named as the op.
# Their names as of jax 0.10, the oldest supported.
_CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",  # `jit`'s primitive before jax 0.7
    "custom_vjp_call_jaxpr": "fun_jaxpr",  # `custom_vjp_call` before jax 0.7
    "closed_call": "call_jaxpr",
    "remat2": "jaxpr",  # `jax.checkpoint`'s primitive
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
}


@dataclasses.dataclass(frozen=True)
class Producer:
    """An equation whose inputs held no inf or NaN that reaches its output."""

    op: str | None  # None only for `locate`'s stand-in when no op is blamed
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
    # An argument that is not finite on entry is its own origin.
    sources: list[int | Producer] = [
        position for position, arg in enumerate(args) if nonfinite(arg)
    ]
    origins = [sources.index(i) if i in sources else None for i in range(len(args))]

    def visit(eqn, inputs, outputs, in_origins, calls):
        # Each output's origin: None if finite, else the inputs' earliest, else here.
        inherited = min((o for o in in_origins if o is not None), default=None)
        bad = [nonfinite(output) for output in outputs]
        if inherited is None and any(bad):
            sources.append(_producer(eqn, calls))
            inherited = len(sources) - 1
        return [inherited if b else None for b in bad]

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

        def read(atoms):  # their values and their tags
            pairs = [
                (v.val, None) if isinstance(v, core.Literal) else env[v] for v in atoms
            ]
            return [value for value, _ in pairs], [tag for _, tag in pairs]

        env.update(zip(jaxpr.constvars, [(c, None) for c in consts], strict=True))
        env.update(zip(jaxpr.invars, zip(values, in_tags, strict=True), strict=True))
        for eqn in jaxpr.eqns:
            inputs, input_tags = read(eqn.invars)
            sub = _sub_jaxpr(eqn)
            operands, operand_tags = inputs, input_tags
            if branches and eqn.primitive.name == "cond":
                sub, operands, operand_tags = _branch(eqn, inputs, input_tags)
            if sub is not None and descend():
                outputs, output_tags = evaluate(
                    sub.jaxpr, sub.consts, operands, operand_tags, (*calls, eqn)
                )
            else:
                # Eagerly, numpy casts literals: an overflow there is what the
                # walk looks for, not a warning for the user.
                with eqn.ctx.manager, np.errstate(over="ignore", invalid="ignore"):
                    outputs = _bind(eqn, inputs)
                if not eqn.primitive.multiple_results:
                    outputs = [outputs]
                output_tags = visit(eqn, inputs, outputs, input_tags, calls)
                output_tags = output_tags or [None] * len(outputs)
            pairs = zip(outputs, output_tags, strict=True)
            env.update(zip(eqn.outvars, pairs, strict=True))
        return read(jaxpr.outvars)

    padded = list(tags) + [None] * (len(args) - len(tags))
    return evaluate(closed.jaxpr, closed.consts, list(args), padded, ())


def _bind(eqn: Any, inputs: list) -> Any:
    """`eqn`'s primitive applied to `inputs`, as `jax.core.eval_jaxpr` does.

    `get_bind_params` gives the parameters (jax 0.7 and on), or before them the
    functions a call primitive binds with (jax 0.6: a pair).
    """
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):
        functions, params = params
        return eqn.primitive.bind(*functions, *inputs, **params)
    return eqn.primitive.bind(*inputs, **params)


def _branch(eqn: Any, inputs: list, tags: list) -> tuple[Any, list, list]:
    """The branch a `cond` takes and its operands; `(None, ...)` if traced."""
    index = inputs[0]
    if isinstance(index, jax.core.Tracer):
        return None, inputs, tags
    branches = eqn.params["branches"]
    chosen = branches[int(np.clip(int(index), 0, len(branches) - 1))]
    return chosen, inputs[1:], tags[1:]


def _sub_jaxpr(eqn: Any) -> Any:
    sub = eqn.params.get(_CALLS.get(eqn.primitive.name))
    if isinstance(sub, core.Jaxpr):
        sub = core.ClosedJaxpr(sub, ())
    if not isinstance(sub, core.ClosedJaxpr):
        return None
    jaxpr = sub.jaxpr
    if len(jaxpr.invars) != len(eqn.invars) or len(jaxpr.outvars) != len(eqn.outvars):
        return None
    return sub


def constant_input(eqn: Any, calls: tuple[Any, ...]) -> Any:
    """The value of `eqn`'s first input if it is a constant, else None.

    A literal of a call around `eqn` counts (`jnp.where` is jitted: its scalar
    operand is a literal of the call, an input of the equation inside).
    """
    if not eqn.invars:
        return None
    atom = eqn.invars[0]
    for call in reversed(calls):
        if isinstance(atom, core.Literal):
            break
        inner = _sub_jaxpr(call)
        invars = list(inner.jaxpr.invars) if inner is not None else []
        if atom not in invars:
            break
        atom = call.invars[invars.index(atom)]
    return atom.val if isinstance(atom, core.Literal) else None


def nonfinite(value: Any) -> bool:
    """Whether a floating-point array holds an inf or a NaN (others: False)."""
    return inexact(value) and not bool(np.isfinite(np.asarray(value)).all())


def inexact(value: Any) -> bool:
    """Whether `value` has a floating-point (or complex) dtype.

    `jnp.issubdtype`, not NumPy's: a typed PRNG key's dtype (`key<fry>`) is not
    a NumPy dtype, and a key is held fixed like an integer.
    """
    return jnp.issubdtype(getattr(value, "dtype", np.int32), jnp.inexact)


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
    skip = _library_dirs(libraries)
    stdlib = os.path.join(os.path.dirname(os.__file__), "")
    for candidate in (eqn, *reversed(calls)):
        traceback = candidate.source_info.traceback
        for frame in traceback.frames if traceback is not None else ():
            name = frame.file_name
            # The standard library's frames (`functools.partial`, ...) are skipped.
            if not name.startswith(skip) and not (
                name.startswith(stdlib) and "-packages" not in name
            ):
                return f"{name}:{frame.line_num}", frame.function_name
    return None, None


def _library_dirs(libraries: tuple[str, ...]) -> tuple[str, ...]:
    """Where `libraries` (and lossscale/_src) live: their frames are skipped."""
    # All of lossscale/_src, wherever in it this module is; not the user's tests.
    files = [getattr(sys.modules.get(name), "__file__", None) for name in libraries]
    dirs = [os.path.dirname(path) for path in [_src.__file__, *files] if path]
    return tuple(os.path.join(d, "") for d in dirs)
