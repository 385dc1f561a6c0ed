"""The steps that run the catalogue's optimizers, and how their results compare.

Every step takes the same inputs, `(params, state, grads, value)` with the
unscaled gradients and the loss, so one set of gradients drives every path:
plain optax (`plain`), `lossscale.wrap` then `optax.apply_updates` (`wrap`),
`lossscale.apply_gradients` (`apply`) and the reference of XLA:CPU's exactness
(`cond_reference`). `Merged` traces the step of every form and entry point into
one program, so that an optimizer costs one compile per layout.

Run as a script, it is the child process of the test that a loop on a gradient
ends on a skipped step: `python catalogue_steps.py FORM PATH`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from catalogue import Entry
from catalogue import halving_while_loop
from catalogue import initial_params
from catalogue import loss
from catalogue import loss_and_grad

import lossscale
from lossscale._src.step import finite

FORMS = ("cpu", "gpu", "tpu")
PATHS = ("wrap", "apply_gradients")

# The loss scale of the guarded runs: a power of two, so unscaling is exact and the
# inner optimizer sees the plain optimizer's gradients; a skip halves it.
INITIAL_SCALE = 16.0

# The programs that are compared within a tolerance compile at XLA:CPU's lowest
# backend optimization: a quarter less compile time, the same HLO, and what they
# check (types, skips, values to `RTOL`) does not depend on LLVM's optimizations.
# The bit-for-bit claims of XLA:CPU's form compile as users' programs do.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def choose_form(form: str) -> Callable:
    """`finite.per_backend` as the `backend_form` fixture sets it, for `form`."""

    def chosen(*args, cpu, gpu, tpu):
        return {"cpu": cpu, "gpu": gpu, "tpu": tpu}[form](*args)

    return chosen


@contextlib.contextmanager
def use_form(form: str):
    """Steps traced inside take `form`, as under the `backend_form` fixture."""
    saved = finite.per_backend
    finite.per_backend = choose_form(form)
    try:
        yield
    finally:
        finite.per_backend = saved


@dataclasses.dataclass
class Path:
    """One way to run an optimizer: `init`, `step` and where its state lies.

    `step(params, state, grads, value) -> (params, state)` takes the unscaled
    gradients and the loss; `view(state)` is `(inner optimizer state, loss-scale
    state or None)`.
    """

    init: Callable
    step: Callable
    view: Callable


def plain(entry: Entry) -> Path:
    tx = entry.transformation()

    def step(params, opt_state, grads, value):
        extra = entry.extra_args(value, grads)
        updates, opt_state = tx.update(grads, opt_state, params, **extra)
        return optax.apply_updates(params, updates), opt_state

    return Path(tx.init, step, lambda state: (state, None))


def _scaled(grads, scale):
    # The gradients of the scaled loss: exact, the scale being a power of two.
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)


def wrap(entry: Entry, loss_scale=None, axis_name=None, apply_updates=True) -> Path:
    """`lossscale.wrap(tx)`, then `optax.apply_updates` (or the updates as they are)."""
    if loss_scale is None:
        loss_scale = lossscale.DynamicLossScale(INITIAL_SCALE)
    wrapped = lossscale.wrap(entry.build(), loss_scale, axis_name=axis_name)

    def step(params, state, grads, value):
        extra = entry.extra_args(value, grads)
        scaled = _scaled(grads, state.loss_scale.scale)
        updates, state = wrapped.update(scaled, state, params, **extra)
        if not apply_updates:
            return updates, state
        return optax.apply_updates(params, updates), state

    return Path(wrapped.init, step, lambda state: (state.inner_state, state.loss_scale))


def apply(entry: Entry, axis_name=None) -> Path:
    """`lossscale.apply_gradients(tx, ...)`, the README's one-call step."""
    tx = entry.transformation()

    def init(params):
        return tx.init(params), lossscale.DynamicLossScale(INITIAL_SCALE)

    def step(params, state, grads, value):
        opt_state, loss_scale = state
        params, opt_state, loss_scale = lossscale.apply_gradients(
            tx,
            grads=_scaled(grads, loss_scale.scale),
            params=params,
            opt_state=opt_state,
            loss_scale=loss_scale,
            axis_name=axis_name,
            **entry.extra_args(value, grads),
        )
        return params, (opt_state, loss_scale)

    return Path(init, step, lambda state: state)


def guarded(entry: Entry, path_name: str, axis_name=None) -> Path:
    if path_name == "wrap":
        return wrap(entry, axis_name=axis_name)
    return apply(entry, axis_name=axis_name)


def cond_reference(entry: Entry) -> Path:
    """What `wrap(tx)` at a scale of 1 promises on XLA:CPU, written plainly.

    `tx.update` inside one `lax.cond` on whether the gradients (and the loss,
    where `update` takes it) are finite; a skip gives negative-zero updates and
    the state as it was. `step` returns the updates.
    """
    tx = entry.transformation()

    def step(params, opt_state, grads, value):
        extra = entry.extra_args(value, grads)
        finite = jnp.asarray(True)
        for leaf in jax.tree.leaves(grads):
            finite = finite & jnp.all(jnp.isfinite(leaf))
        if "value" in extra:
            finite = finite & jnp.isfinite(value)

        def applied():
            return tx.update(grads, opt_state, params, **extra)

        def skipped():
            shapes = jax.eval_shape(applied)[0]
            zeros = jax.tree.map(lambda s: jnp.full(s.shape, -0.0, s.dtype), shapes)
            return zeros, opt_state

        return jax.lax.cond(finite, applied, skipped)

    return Path(tx.init, step, lambda state: (state, None))


# -- the steps' inputs: two finite steps, then an inf in a matrix, then in the scalar --

FINITE_STEPS = 2
POISONED = ("w", "s")  # the leaf of each non-finite step that gets an inf


def poisons() -> list:
    """What each step adds to the gradients: zeros, then an inf in each of POISONED."""
    zeros = jax.tree.map(np.zeros_like, initial_params())
    zeros = jax.tree.map(np.asarray, zeros)
    steps = [zeros] * FINITE_STEPS
    for name in POISONED:
        leaf = np.zeros_like(zeros[name])
        leaf[(0,) * leaf.ndim] = np.inf
        steps.append({**zeros, name: leaf})
    return steps


def run(path: Path, step: Callable, scale=1.0) -> list:
    """`step` (a jitted `path.step`) over the steps; (params, state) after each.

    The gradients and the loss at each step's parameters come from one program,
    `loss_and_grad`: two runs that stay bit for bit equal get equal inputs.
    """
    params = initial_params()
    state = path.init(params)
    results = [(params, state)]
    for poison in poisons():
        value, grads = loss_and_grad(params)
        grads = jax.tree.map(lambda g, p: g + p, grads, poison)
        params, state = step(params, state, grads, value)
        results.append((params, state))
    return results


# -- every form and entry point in one program, with plain optax ---------------------

PLAIN = ("plain", "optax")


@dataclasses.dataclass
class Layout:
    """Where a merged step's arrays lie, and how its step is mapped.

    `place(tree)` puts parameters, states or the loss on the devices;
    `place_poison` what a step adds to the gradients (per device, in a
    `shard_map`); `map_step(step)` the step as the layout runs it, whose
    `local(step)` turns the gradients and loss it computes into what the
    optimizers see (the mean over devices, in a `shard_map`).
    """

    name: str
    forms: tuple = FORMS
    axis_name: str | None = None
    place: Callable = lambda tree: tree
    place_poison: Callable = lambda poison: poison
    map_step: Callable = lambda step: step
    local: Callable = lambda value, grads, poison: (value, _added(grads, poison))


def _added(grads, poison):
    return jax.tree.map(lambda g, p: g + p.astype(g.dtype), grads, poison)


class Merged:
    """Plain optax and the step of each (form, entry point), in one program.

    XLA:CPU's compile time is mostly fixed per program: seven steps compile in
    about twice the time of one. Each layout of `layouts` runs plain optax and
    its forms' steps, keyed `(layout name, form, entry point)` (`PLAIN` for
    plain optax's form and entry point). Each step computes the loss and its
    gradients at its own parameters, then adds the step's poison (zeros, or an
    inf). A step that fails to trace is left out and its exception kept in
    `errors`: the others still run.
    """

    def __init__(self, entry: Entry, layouts: list[Layout]):
        self.layouts = layouts
        self.paths = {}
        for layout in layouts:
            self.paths[layout.name, *PLAIN] = plain(entry)
            for form in layout.forms:
                for name in PATHS:
                    path = guarded(entry, name, layout.axis_name)
                    self.paths[layout.name, form, name] = path
        self.errors: dict[tuple, BaseException] = {}
        self.step = jax.jit(self._all_steps, compiler_options=FAST_COMPILE)

    def _all_steps(self, params, states, poisons):
        new_params, new_states = {}, {}
        for layout in self.layouts:
            keys = [key for key in self.paths if key[0] == layout.name]
            mapped = layout.map_step(functools.partial(self._steps, layout, keys))
            mine = [{key: tree[key] for key in keys} for tree in (params, states)]
            results = mapped(*mine, poisons[layout.name])
            new_params.update(results[0])
            new_states.update(results[1])
        return new_params, new_states

    def _steps(self, layout, keys, params, states, poison):
        new_params, new_states = {}, {}
        for key in keys:
            value, grads = jax.value_and_grad(loss)(params[key])
            value, grads = layout.local(value, grads, poison)
            form = key[1]
            with use_form(form) if form in FORMS else contextlib.nullcontext():
                try:
                    new_params[key], new_states[key] = self.paths[key].step(
                        params[key], states[key], grads, value
                    )
                except Exception as error:  # kept: its test raises it
                    self.errors[key] = error
                    new_params[key], new_states[key] = params[key], states[key]
        return new_params, new_states

    def run(self) -> dict[tuple, list]:
        """Each step's (params, state) after each of the steps (`poisons`)."""
        params, states = {}, {}
        for layout in self.layouts:
            for key, path in self.paths.items():
                if key[0] == layout.name:
                    params[key] = layout.place(initial_params())
                    states[key] = layout.place(path.init(params[key]))
        results = {key: [(params[key], states[key])] for key in self.paths}
        for poison in poisons():
            placed = {
                layout.name: layout.place_poison(poison) for layout in self.layouts
            }
            params, states = self.step(params, states, placed)
            for key in self.paths:
                results[key].append((params[key], states[key]))
        return results


# -- comparisons ----------------------------------------------------------------------

RTOL = 1e-5  # the bound against the unwrapped optimizer, on finite steps


def _leaves(tree):
    return jax.tree_util.tree_leaves_with_path(tree)


def bits(x) -> np.ndarray:
    """The bit pattern of an array (a typed PRNG key's data), as unsigned ints."""
    x = x if isinstance(x, jax.Array) else jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    array = np.asarray(x)
    return array.view(np.dtype(f"u{array.dtype.itemsize}"))


def _same_tree(got, want, what):
    assert jax.tree.structure(got) == jax.tree.structure(want), (
        f"{what}: trees differ:\n{jax.tree.structure(got)}\n{jax.tree.structure(want)}"
    )


def assert_bitwise(got, want, what):
    """Same tree, dtypes and bits (-0.0 is not +0.0, NaN payloads count)."""
    _same_tree(got, want, what)
    for (path, a), (_, b) in zip(_leaves(got), _leaves(want), strict=True):
        where = f"{what}{jax.tree_util.keystr(path)}"
        assert jnp.result_type(a) == jnp.result_type(b), (
            f"{where}: dtype {jnp.result_type(a)}, expected {jnp.result_type(b)}"
        )
        np.testing.assert_array_equal(
            bits(a), bits(b), err_msg=f"{where}: bits differ: {a!r} vs {b!r}"
        )


def assert_close(got, want, what):
    """Within `RTOL` of each leaf's largest magnitude; integers and keys exactly."""
    _same_tree(got, want, what)
    for (path, a), (_, b) in zip(_leaves(got), _leaves(want), strict=True):
        where = f"{what}{jax.tree_util.keystr(path)}"
        dtype = jnp.result_type(b)
        assert jnp.result_type(a) == dtype, f"{where}: dtype {jnp.result_type(a)}"
        if not jnp.issubdtype(dtype, jnp.inexact):
            np.testing.assert_array_equal(bits(a), bits(b), err_msg=where)
            continue
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = np.abs(b).max(initial=0.0)
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL * scale, err_msg=where)


def signature(tree) -> tuple:
    """What `jax.jit` compiles a program for: the tree, types and shardings."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((jax.typeof(x), x.sharding) for x in leaves)


def compiles(results) -> int:
    """How many programs a step fed its own outputs compiles over `results`."""
    return len({signature(result) for result in results[:-1]})


def check_run(what, view, results, want):
    """Finite steps as plain optax's (`want`); skips keep everything, and count.

    The step's outputs are typed (and laid out) as its inputs, so a train loop
    compiles it once, unless plain optax's are not either.
    """
    for k in range(1, FINITE_STEPS + 1):
        params, state = results[k]
        inner, loss_scale = view(state)
        assert_close(params, want[k][0], f"{what}, step {k}: params")
        assert_close(inner, want[k][1], f"{what}, step {k}: optimizer state")
        assert int(loss_scale.skipped_steps) == 0, (what, k)
        assert float(loss_scale.scale) == INITIAL_SCALE, (what, k)
    kept_params, kept_state = results[FINITE_STEPS]
    for k in range(FINITE_STEPS + 1, len(results)):
        params, state = results[k]
        inner, loss_scale = view(state)
        assert_bitwise(params, kept_params, f"{what}, skipped step {k}: params")
        assert_bitwise(inner, view(kept_state)[0], f"{what}, skipped step {k}: state")
        skips = k - FINITE_STEPS
        assert int(loss_scale.skipped_steps) == skips, (what, k)
        assert float(loss_scale.scale) == INITIAL_SCALE / 2**skips, (what, k)
    assert compiles(results) <= compiles(want), (
        f"{what}: a loop of this step compiles {compiles(results)} programs,"
        f" plain optax's {compiles(want)}; the types of each step's inputs:\n"
        + "\n".join(str(signature(r)) for r in results)
    )


# -- the child of the test that a loop on a gradient ends on a skipped step -----------


def _loop_child(form: str, *path_names: str) -> None:
    """Compiles `halving_while_loop`'s guarded steps, then runs each on a finite
    and on an inf step, printing what it has done."""
    finite.per_backend = choose_form(form)
    params = initial_params()
    value, grads = loss_and_grad(params)
    compiled = {}
    for name in path_names:
        path = guarded(Entry("halving_while_loop", halving_while_loop), name)
        state = path.init(params)
        step = jax.jit(path.step).lower(params, state, grads, value).compile()
        compiled[name] = path, state, step
    print("compiled", flush=True)
    poisoned = {**grads, "s": jnp.asarray(jnp.inf, jnp.float32)}
    for name, (path, state, step) in compiled.items():
        new_params, state = jax.block_until_ready(step(params, state, grads, value))
        _, state = jax.block_until_ready(step(new_params, state, poisoned, value))
        print(name, "skipped", int(path.view(state)[1].skipped_steps), flush=True)


if __name__ == "__main__":
    import sys

    _loop_child(*sys.argv[1:])
