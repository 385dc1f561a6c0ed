"""XLA:CPU's skip, split into parts (`step/split.py`), against its definition.

A part holds every equation its outputs depend on and reads the inputs those
equations read, in the step's order. `split.plan` finds all parts in one pass over
the step; the reference here walks the step once per part, as the definition reads.
"""

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import pytest

from lossscale._src.step import inline
from lossscale._src.step import split


def reference_part(jaxpr, positions):
    """The equations the outputs at `positions` depend on, and the inputs they read."""
    needed = {v for v in (jaxpr.outvars[k] for k in positions) if _is_var(v)}
    eqns = []
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars if _is_var(v)):
            eqns.append(eqn)
            needed.update(v for v in eqn.invars if _is_var(v))
    places = [*jaxpr.constvars, *jaxpr.invars]
    return eqns[::-1], tuple(i for i, v in enumerate(places) if v in needed)


def _is_var(v):
    return isinstance(v, jcore.Var)


def step(params, moments, count):
    """An optimizer's update, written out: per-leaf moments, and scalars from the
    count (a schedule, a bias correction) that every leaf's update reads."""
    learning_rate = 0.01 * jnp.cos(count.astype(jnp.float32) / 100)
    correction = 1 - 0.9 ** (count + 1).astype(jnp.float32)
    moments = {k: 0.9 * m + params[k] for k, m in moments.items()}
    params = {k: p - learning_rate * moments[k] / correction for k, p in params.items()}
    return params, moments, count + 1


def test_each_part_holds_what_its_outputs_depend_on_and_scalars_are_copied():
    # Twelve matrices and a scalar parameter, parts of at most 6 outputs: many parts
    # (jax's own jaxpr, not optax's, whose structure changes between versions).
    params = {f"w{i}": jnp.full((4, 3), 0.1 * i) for i in range(12)}
    params["t"] = jnp.float32(1.0)
    moments = jax.tree.map(jnp.zeros_like, params)
    closed = jax.make_jaxpr(step)(params, moments, jnp.int32(0))
    jaxpr = closed.jaxpr
    outputs = range(len(jaxpr.outvars))
    parts = split.plan(closed, outputs, part_outputs=6)

    assert len(parts) > 4, len(parts)
    assert sorted(k for part in parts for k in part.positions) == list(outputs)
    for part in parts:
        eqns, held = reference_part(jaxpr, part.positions)
        assert [id(e) for e in part.jaxpr.jaxpr.eqns] == [id(e) for e in eqns]
        assert part.held == held
        places = [*jaxpr.constvars, *jaxpr.invars]
        assert part.jaxpr.jaxpr.invars == [places[i] for i in held]
    # Equations on scalars (the schedule, the bias corrections) run in each part
    # that reads them; no other equation is in two parts.
    counts = {}
    for part in parts:
        for eqn in part.jaxpr.jaxpr.eqns:
            counts[id(eqn)] = (counts.get(id(eqn), (0, eqn))[0] + 1, eqn)
    shared = [eqn for n, eqn in counts.values() if n > 1]
    assert shared and all(split._on_scalars(eqn) for eqn in shared)


@jax.jit
def _corrected(moments, count):
    # A jitted map over the whole tree, as optax's `tree_bias_correction` is (on
    # jax 0.12 one equation until lowering): one equation that gives every leaf.
    correction = 1 - 0.9 ** (count + 1).astype(jnp.float32)
    return {k: m / correction for k, m in moments.items()}, moments, 2.0


def jitted_step(params, moments, count):
    # The jitted map called twice alike: both calls hold one traced body.
    first, same, _ = _corrected(moments, count)
    second, _, constant = _corrected(moments, count)
    return (
        {k: p - 0.01 * first[k] * second[k] for k, p in params.items()},
        same,
        constant,
    )


def test_calls_over_the_tree_are_inlined_into_parts():
    params = {f"w{i}": jnp.full((4, 3), 0.1 * i) for i in range(12)}
    moments = jax.tree.map(lambda p: p + 1, params)
    args = (params, moments, jnp.int32(3))
    closed = jax.make_jaxpr(jitted_step)(*args)
    outputs = range(len(closed.jaxpr.outvars))
    assert len(split.plan(closed, outputs, part_outputs=2)) == 1  # one call joins

    inlined = inline.inlined(closed)
    jcore.check_jaxpr(inlined.jaxpr)
    defined = [v for e in inlined.jaxpr.eqns for v in e.outvars if _is_var(v)]
    defined = [v for v in defined if not isinstance(v, jcore.DropVar)]
    assert len(set(defined)) == len(defined)  # the body's two calls renamed apart
    assert not any(inline.joins(eqn) for eqn in inlined.jaxpr.eqns)
    places = [*inlined.jaxpr.constvars, *inlined.jaxpr.invars]
    assert places == [*closed.jaxpr.constvars, *closed.jaxpr.invars]
    # The moments come back as they went in: the step's own inputs, by identity.
    moment_places = places[len(params) : 2 * len(params)]
    assert inlined.jaxpr.outvars[len(params) : 2 * len(params)] == moment_places
    assert len(split.plan(inlined, outputs, part_outputs=2)) >= 6
    # The same values, bit for bit: the same program, to XLA, which inlines calls.
    flat = jax.tree.leaves(args)
    expected = jax.jit(jcore.jaxpr_as_fun(closed))(*flat)
    got = jax.jit(jcore.jaxpr_as_fun(inlined))(*flat)
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert jnp.array_equal(a, b), (a, b)


def _two(x, y):
    return x * 2.0, y * 3.0


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(
            lambda: jax.jit(_two, out_shardings=_one_device()), id="shardings"
        ),
        pytest.param(
            lambda: jax.jit(_two, inline=jax.Inline.XLA_LATE),
            id="xla-late",
            marks=pytest.mark.skipif(
                not hasattr(jax, "Inline"), reason="jax.Inline: jax 0.12 on"
            ),
        ),
    ],
)
def test_calls_that_xla_would_not_inline_alike_stay_calls(call):
    # Spliced, a call's own shardings would be lost, and a call that XLA inlines
    # after fusion would fuse with its neighbours: other bits.
    x = jnp.arange(4.0)
    closed = jax.make_jaxpr(lambda a, b: call()(a, b))(x, x + 1)
    (eqn,) = closed.jaxpr.eqns
    assert eqn.primitive.name in ("jit", "pjit")
    assert not inline.joins(eqn)
    assert inline.inlined(closed) is closed


def _one_device():
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])
