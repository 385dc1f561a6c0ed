"""optax's whole catalogue through `wrap` and `apply_gradients`, in every form.

For every optimizer of optax's aliases and `optax.contrib` (enumerated from optax:
`catalogue.py`) and the combinators users train with, on a tree of mixed shapes
with a scalar leaf, through `wrap` (then `optax.apply_updates`) and
`apply_gradients`, in the three forms of the step: two finite steps give plain
optax's parameters and state (to `RTOL`), a step with an inf in a matrix and one
with an inf in the scalar keep them bit for bit and are counted, and each step
compiles once; the same under `NamedSharding` on eight devices and in a
data-parallel `shard_map`. A loop on a gradient ends on a skipped step (XLA:CPU). On
XLA:CPU, `wrap(tx)` at a scale of 1 is `tx.update` in one `lax.cond`, bit for
bit, and `apply_gradients` is `wrap(tx)` then `optax.apply_updates`, bit for bit.

The whole catalogue is marked slow; a subset, one optimizer of each shape of
state, stays in the quick loop. Compiles are the cost, so plain optax and the
(form, entry point) steps of an optimizer are traced into one program per layout
(`catalogue_steps.Merged`), switching the form as the `backend_form` fixture
does; a test per (optimizer, form, entry point) checks its own step's results.
A worker shares the merged run among an optimizer's tests, and xdist sends a
worker consecutive tests: an optimizer's tests mostly share one run.
"""

import functools
import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time

import catalogue
import catalogue_steps as steps
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from catalogue_steps import FORMS
from catalogue_steps import PATHS
from catalogue_steps import assert_bitwise
from helpers import DEVICES
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lossscale

# One optimizer of each shape of state, in the quick loop.
QUICK = {
    "adam",  # moments and a count
    "contrib.prodigy",  # scalar estimates beside the moments
    "polyak_sgd",  # takes the loss: `value`
    "multi_transform(adam,set_to_zero)",  # a frozen scalar parameter
    "MultiSteps(adam,2)",  # accumulation: `wrap`'s own path
    "asarray_state(global_norm)",  # a weakly typed state scalar
}
QUICK_EXACT = {"adam", "inject_hyperparams(adam,schedule)", "contrib.prodigy"}
# Where `apply_gradients` adds the updates does not depend on the optimizer (the
# same rounding before the same add, `step.py`): the quick subset and optimizers
# whose updates end in a sign, a scalar's estimate or a chain's last scaling, not
# the whole catalogue (which would cost a fifth more of its time).
APPLY_EXACT = QUICK_EXACT | {
    "lion",
    "contrib.dadapt_adamw",
    "sgd",
    "MultiSteps(adam,2)",
}
QUICK_SHARDED = {"chain(clip_by_global_norm,adamw(schedule))"}

CATALOGUE = catalogue.catalogue()
slow = pytest.mark.slow


def cases(quick, slow_forms=FORMS, layouts=("one device",)):
    """(entry, layout, form, entry point) params, an optimizer's consecutive (its
    tests share one program); slow unless the optimizer is in `quick`, then in
    `slow_forms` only."""
    return [
        pytest.param(
            entry,
            layout,
            form,
            path,
            id="-".join(
                [entry.name, *([layout] if len(layouts) > 1 else []), form + "-form"]
                + [path]
            ),
            marks=() if entry.name in quick else slow,
        )
        for entry in CATALOGUE
        for layout in layouts
        for form in (FORMS if entry.name in quick else slow_forms)
        for path in PATHS
    ]


def entries(quick, only=None):
    return [
        pytest.param(entry, id=entry.name, marks=() if entry.name in quick else slow)
        for entry in CATALOGUE
        if only is None or entry.name in only
    ]


@functools.cache
def merged_run(name, program):
    """Plain optax's and every step's run of `name` in the layouts of `program`."""
    (entry,) = catalogue.by_name([name])
    merged = steps.Merged(
        entry, [layout(name) for layout in PROGRAMS[program].values()]
    )
    try:
        return merged, merged.run(), None
    except Exception as error:  # compiling or running the program: every step's
        return merged, None, error


def check_merged(entry, form, path_name, layout_name):
    program = next(p for p, layouts in PROGRAMS.items() if layout_name in layouts)
    merged, results, error = merged_run(entry.name, program)
    key, plain = (layout_name, form, path_name), (layout_name, *steps.PLAIN)
    if plain in merged.errors and key in merged.errors:  # nothing to compare with
        # (on jax 0.6.1 `optax.noisy_sgd` in a `shard_map`: `jax.random.normal` with
        # the leaf's `out_sharding` raises NotImplementedError)
        pytest.skip(f"plain optax fails here too: {merged.errors[plain]!r}")
    for failed in (key, plain):
        if failed in merged.errors:
            raise merged.errors[failed]
    if error is not None:
        raise error
    steps.check_run(
        f"{entry.name} by {path_name} in the {form} form, {layout_name}",
        merged.paths[key].view,
        results[key],
        results[plain],
    )


# -- the catalogue ---------------------------------------------------------------------


def test_every_public_optimizer_of_optax_is_run_or_excluded():
    unclassified = catalogue.unclassified()
    assert not unclassified, (
        f"optax has functions the catalogue cannot build: {unclassified}. Give"
        " their arguments in `catalogue.ARGUMENTS`, or say in `catalogue.EXCLUDED`"
        " why they cannot run on the tests' tree."
    )
    public = catalogue.public_functions()
    for table in (catalogue.EXCLUDED, catalogue.ARGUMENTS, catalogue.NEEDS):
        stale = sorted(set(table) - set(public))
        assert not stale, f"names optax no longer has: {stale}"
    names = {entry.name for entry in CATALOGUE}
    assert {"adam", "sgd", "lbfgs", "contrib.dog", "contrib.prodigy"} <= names
    # The subsets name optimizers the catalogue has: none drops out unseen.
    for subset in (QUICK, QUICK_EXACT, APPLY_EXACT, QUICK_SHARDED):
        assert subset <= names, sorted(subset - names)
    assert not names & set(catalogue.EXCLUDED)


@pytest.mark.parametrize(
    "name", [n for n, e in catalogue.EXCLUDED.items() if e.fails_on_the_tree]
)
def test_each_exclusion_fails_in_plain_optax_on_the_tree(name):
    function = catalogue.public_functions()[name]
    entry = catalogue.Entry(name, catalogue.builder(function, name))
    path = steps.plain(entry)
    with pytest.raises(Exception) as info:  # noqa: B017  # whatever optax raises
        steps.run(path, jax.jit(path.step))
    assert not isinstance(info.value, Warning), info.value


@pytest.mark.parametrize(
    "name", [n for n, e in catalogue.EXCLUDED.items() if not e.fails_on_the_tree]
)
def test_each_other_exclusion_is_not_an_optimizer(name):
    # A factory of something else than an optimizer step, as its reason says.
    assert catalogue.EXCLUDED[name].reason.startswith("not a")


@pytest.mark.parametrize(("entry", "layout", "form", "path_name"), cases(QUICK))
def test_matches_plain_optax_and_skips_bit_for_bit(entry, layout, form, path_name):
    check_merged(entry, form, path_name, layout)


# -- XLA:CPU's exactness (compiled as users' programs are) -----------------------------


@pytest.mark.parametrize("backend_form", ["cpu"], indirect=True)
@pytest.mark.parametrize("entry", entries(QUICK_EXACT))
def test_wrap_at_a_scale_of_one_is_the_update_in_one_cond(entry, backend_form):
    want = steps.cond_reference(entry)
    # The pages' clause: with nothing to unscale. (A dynamic scale, even at 1,
    # multiplies by its inverse, which XLA:CPU contracts otherwise: last bits.)
    scale = lossscale.StaticLossScale(1.0)
    got = steps.wrap(entry, scale, apply_updates=False)
    want_step, got_step = jax.jit(want.step), jax.jit(got.step)
    params = got_params = catalogue.initial_params()
    state, got_state = want.init(params), got.init(params)
    for k, poison in enumerate(steps.poisons(), start=1):
        value, grads = catalogue.loss_and_grad(params)
        grads = jax.tree.map(lambda g, p: g + p, grads, poison)
        updates, state = want_step(params, state, grads, value)
        got_updates, got_state = got_step(got_params, got_state, grads, value)
        what = f"{entry.name}, step {k}"
        assert_bitwise(got_updates, updates, f"{what}: updates")
        assert_bitwise(got.view(got_state)[0], state, f"{what}: optimizer state")
        params = optax.apply_updates(params, updates)
        got_params = optax.apply_updates(got_params, got_updates)


@pytest.mark.parametrize("backend_form", ["cpu"], indirect=True)
@pytest.mark.parametrize("entry", entries(QUICK_EXACT, APPLY_EXACT))
def test_apply_gradients_is_wrap_then_apply_updates(entry, backend_form):
    runs = {}
    for path_name in PATHS:
        path = steps.guarded(entry, path_name)
        runs[path_name] = path, steps.run(path, jax.jit(path.step))
    (wrap, wrapped), (apply, applied) = runs["wrap"], runs["apply_gradients"]
    for k, ((want_params, want), (got_params, got)) in enumerate(
        zip(wrapped, applied, strict=True)
    ):
        what = f"{entry.name}, step {k}"
        assert_bitwise(got_params, want_params, f"{what}: params")
        assert_bitwise(apply.view(got), wrap.view(want), f"{what}: state")


# -- sharded: NamedSharding on eight devices, a data-parallel shard_map --------------

needs_8_devices = pytest.mark.skipif(len(DEVICES) < 8, reason="needs 8 CPU devices")

# Where each shape lies: a matrix's rows, another's columns across the devices, the
# rest (the scalar, counts, the loss-scale state) replicated. States follow the
# parameters, so a step's outputs lie where its inputs did: one compile.
SPECS = {(8, 4): P("data", None), (4, 8): P(None, "data")}

# Sharded, the whole catalogue runs in XLA:CPU's form, which builds its skip from
# each optimizer's jaxpr (and whose `lax.cond` must reconcile sharded types); the
# select forms of GPUs and TPUs, one `select_n` per output of the same jaxpr,
# run sharded for the quick subset. Every form runs the whole catalogue on one
# device. (All of it in every form and layout: 2x the compile time.)
SHARDED_FORMS = ("cpu",)


def _mesh():
    return Mesh(np.array(DEVICES[:8]), ("data",))


def _forms(name):
    return FORMS if name in QUICK_SHARDED else SHARDED_FORMS


def _named(name):
    mesh = _mesh()

    def place(tree):
        return jax.tree.map(
            lambda x: jax.device_put(
                x, NamedSharding(mesh, SPECS.get(jnp.shape(x), P()))
            ),
            tree,
        )

    return steps.Layout("NamedSharding", _forms(name), place=place, place_poison=place)


def _shard_map(name):
    mesh = _mesh()

    def place(tree):
        return jax.device_put(tree, NamedSharding(mesh, P()))

    def place_poison(poison):
        # Each device's: a step's inf on device 3 only, which the mean spreads to
        # all (the decision is agreed over `axis_name` as well).
        stacked = jax.tree.map(lambda p: np.stack([np.zeros_like(p)] * 8), poison)
        for leaf, p in zip(
            jax.tree.leaves(stacked), jax.tree.leaves(poison), strict=True
        ):
            leaf[3] = p
        return jax.device_put(stacked, NamedSharding(mesh, P("data")))

    def local(value, grads, poison):
        grads = jax.tree.map(lambda g, p: g + p[0], grads, poison)
        return jax.lax.pmean((value, grads), "data")

    def map_step(step):
        return jax.shard_map(
            step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P()
        )

    return steps.Layout(
        "shard_map", _forms(name), "data", place, place_poison, map_step, local
    )


# The programs, each of the layouts it runs: the sharded layouts share one.
PROGRAMS = {
    "one device": {"one device": lambda name: steps.Layout("one device")},
    "sharded": {"NamedSharding": _named, "shard_map": _shard_map},
}


@needs_8_devices
@pytest.mark.parametrize(
    ("entry", "layout", "form", "path_name"),
    cases(QUICK_SHARDED, SHARDED_FORMS, tuple(PROGRAMS["sharded"])),
)
def test_sharded_matches_plain_optax_and_skips_bit_for_bit(
    entry, layout, form, path_name
):
    """`NamedSharding` on eight devices, and a data-parallel `shard_map`."""
    check_merged(entry, form, path_name, layout)


# -- a loop on a gradient ends on a skipped step ---------------------------------------

# A child compiles in ~5 s; on a loaded 2-core machine allow far more. Once compiled,
# its two steps take milliseconds: a child still running after RUN_TIMEOUT is in a
# loop that does not end.
COMPILE_TIMEOUT = 120
RUN_TIMEOUT = 10


@functools.cache
def loop_results(form):
    """{entry point: None, or why its step did not end}, from child processes.

    A child compiles the step of each entry point still to run, then runs each
    on a finite and on an inf step; one that hangs is killed, and the next
    child runs the entry points after it.
    """
    here = pathlib.Path(__file__).resolve().parent
    package = pathlib.Path(lossscale.__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(here), str(package), *filter(None, [env.get("PYTHONPATH")])]
    )
    results, remaining = {}, list(PATHS)
    while remaining:
        child = subprocess.Popen(
            [sys.executable, str(here / "catalogue_steps.py"), form, *remaining],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,  # its own process group, killed as one
        )
        lines = queue.Queue()

        def read(child=child, lines=lines):
            for line in child.stdout:
                lines.put(line.rstrip())
            lines.put(None)  # the child exited

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        output = []

        def expect(wanted, timeout, output=output, lines=lines):
            # The line `wanted`, after any others, within `timeout` seconds.
            deadline = time.monotonic() + timeout
            while (left := deadline - time.monotonic()) > 0:
                try:
                    line = lines.get(timeout=left)
                except queue.Empty:
                    break
                if line is None:
                    return "the child exited:\n" + "\n".join(output[-40:])
                output.append(line)
                if line == wanted:
                    return None
            return f"no {wanted!r} within {timeout} s"

        try:
            failure = expect("compiled", COMPILE_TIMEOUT)
            if failure is not None:
                raise AssertionError(f"the child did not compile: {failure}")
            while remaining:
                name = remaining.pop(0)
                results[name] = expect(f"{name} skipped 1", RUN_TIMEOUT)
                if results[name] is not None:
                    break  # hung (or failed): the rest in a new child
        finally:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            reader.join(timeout=5)
            child.stdout.close()
    return results


# XLA:CPU's form only: the select forms of GPUs and TPUs run the update on a
# skipped step and discard it, so a loop over an inf runs there; the pages say so,
# and test_exactness.py shows it with a callback (a hang here would cost its timeout).
@pytest.mark.parametrize("path_name", PATHS)
@pytest.mark.parametrize("form", [pytest.param("cpu", id="cpu-form")])
def test_a_loop_on_a_gradient_ends_on_a_skipped_step(form, path_name):
    """`catalogue.halving_while_loop` halves the scalar's gradient while >= 1.

    On the skipped step's inf it never ends: a step that runs it there hangs. In
    child processes, so that a hang fails this test instead of hanging the suite.
    """
    failure = loop_results(form)[path_name]
    assert failure is None, (
        f"{path_name} in the {form} form: {failure}; the step runs the loop on"
        " the skipped step's inf"
    )


def test_the_loop_ends_on_finite_gradients():
    # The transformation of the test above is an ordinary one on finite values.
    tx = catalogue.halving_while_loop()
    params = catalogue.initial_params()
    grads = {**jax.tree.map(jnp.zeros_like, params), "s": jnp.float32(6.0)}
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["s"], -catalogue.LEARNING_RATE * 0.75, rtol=1e-6)
