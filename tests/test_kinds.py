"""The built-in kinds and `update` (`_src/state/kinds.py`, `_src/state/update.py`):
the dynamic rule against a pure-Python model, settings as static data, bad settings."""

import copy
import json
import pickle
import re

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import ReferenceDynamicRule
from hypothesis import given
from hypothesis.stateful import RuleBasedStateMachine
from hypothesis.stateful import initialize
from hypothesis.stateful import invariant
from hypothesis.stateful import rule

import lossscale

pytestmark = pytest.mark.usefixtures("strict_promotion")

jitted_update = jax.jit(lossscale.update)

SETTINGS = st.fixed_dictionaries(
    {
        "scale": st.sampled_from([1.0, 8.0, 2.0**15, 3.0]),
        "growth_interval": st.integers(1, 4),
        "growth_factor": st.sampled_from([2.0, 3.0, 1.5]),
        "backoff_factor": st.sampled_from([0.5, 0.25, 0.7]),
        "min_scale": st.sampled_from([1.0, 0.5, 2.0**-10]),
        "max_scale": st.sampled_from([2.0**16, 2.0**24, 100.0]),
        "hysteresis": st.integers(1, 3),
    }
).filter(lambda s: s["min_scale"] <= s["scale"] <= s["max_scale"])


def assert_matches_reference(state, reference):
    assert np.float32(state.scale) == reference.scale
    assert int(state.counter) == reference.counter
    assert int(state.skipped_steps) == reference.skipped_steps
    assert int(state.consecutive_skips) == reference.consecutive_skips
    assert int(state.forward_overflows) == reference.forward_overflows
    assert bool(state.stuck) == reference.stuck
    assert np.float32(state.overflow_scale) == reference.overflow_scale


class DynamicRuleMachine(RuleBasedStateMachine):
    """Random runs of finite/non-finite steps against the pure-Python model."""

    @initialize(settings=SETTINGS)
    def start(self, settings):
        self.settings = settings
        self.state = lossscale.DynamicLossScale(**settings)
        self.reference = ReferenceDynamicRule(**settings)

    @rule(finite=st.booleans(), loss_finite=st.sampled_from([True, True, False]))
    def step(self, finite, loss_finite=True):
        self.state = jitted_update(
            self.state, jnp.asarray(finite), jnp.asarray(loss_finite)
        )
        self.reference.step(finite, loss_finite)

    @rule(finite=st.booleans(), count=st.integers(2, 12))
    def run_of_steps(self, finite, count):
        for _ in range(count):
            self.step(finite)

    @invariant()
    def same_as_reference(self):
        assert_matches_reference(self.state, self.reference)

    @invariant()
    def scale_within_bounds(self):
        scale = np.float32(self.state.scale)
        assert np.isfinite(scale)
        assert self.settings["min_scale"] <= scale <= self.settings["max_scale"]

    @invariant()
    def settings_unchanged(self):
        for name, value in self.settings.items():
            if name != "scale":
                # Float settings are kept as the float32 values the rule uses.
                assert getattr(self.state, name) == np.float32(value)


TestDynamicRuleMachine = DynamicRuleMachine.TestCase


@given(settings=SETTINGS, flags=st.lists(st.booleans(), min_size=1, max_size=120))
def test_dynamic_rule_matches_reference_under_scan(settings, flags):
    def body(state, finite):
        state = lossscale.update(state, finite)
        return state, (state.scale, state.counter)

    _, (scales, counters) = jax.lax.scan(
        body, lossscale.DynamicLossScale(**settings), jnp.asarray(flags)
    )
    reference = ReferenceDynamicRule(**settings)
    for index, finite in enumerate(flags):
        reference.step(finite)
        assert np.float32(scales[index]) == reference.scale, index
        assert int(counters[index]) == reference.counter, index


def test_default_settings_are_keras():
    state = lossscale.DynamicLossScale()
    assert float(state.scale) == 2.0**15
    assert state.growth_interval == 2000
    assert (state.growth_factor, state.backoff_factor) == (2.0, 0.5)
    assert (state.min_scale, state.max_scale, state.hysteresis) == (1.0, 2.0**24, 1)


def test_scale_grows_on_the_growth_interval_th_finite_step():
    def run(steps):
        flags = jnp.ones([steps], jnp.bool_)
        state, _ = jax.lax.scan(
            lambda s, f: (lossscale.update(s, f), None),
            lossscale.DynamicLossScale(),
            flags,
        )
        return state

    assert float(run(1999).scale) == 2.0**15
    assert int(run(1999).counter) == 1999
    assert float(run(2000).scale) == 2.0**16
    assert int(run(2000).counter) == 0


def test_hysteresis_backs_off_only_after_that_many_overflows_since_growth():
    state = lossscale.DynamicLossScale(scale=64.0, hysteresis=3)
    scales = []
    for finite in [False, True, False, False, False, True]:
        state = lossscale.update(state, jnp.asarray(finite))
        scales.append(float(state.scale))
    # Overflows 1 and 2 are tolerated (a finite step between does not reset the
    # count); the 3rd backs off and so does every later one until a growth.
    assert scales == [64.0, 64.0, 64.0, 32.0, 16.0, 16.0]


def test_scale_never_leaves_bounds_even_with_extreme_factors():
    state = lossscale.DynamicLossScale(
        scale=2.0**100,
        growth_interval=1,
        growth_factor=2.0**20,
        backoff_factor=2.0**-30,
        min_scale=2.0**-100,
        max_scale=2.0**120,
    )
    for _ in range(20):
        state = lossscale.update(state, jnp.asarray(True))
    assert float(state.scale) == 2.0**120
    for _ in range(20):
        state = lossscale.update(state, jnp.asarray(False))
    assert float(state.scale) == 2.0**-100


@pytest.mark.parametrize(
    "make",
    [
        lossscale.NoOpLossScale,
        lambda: lossscale.StaticLossScale(8.0),
        lambda: lossscale.DynamicLossScale(min_scale=0.25, hysteresis=2),
    ],
)
def test_skip_counters_for_every_kind(make):
    state = make()
    for finite in [False, False, True, False]:
        state = lossscale.update(state, jnp.asarray(finite))
    assert int(state.skipped_steps) == 3
    assert int(state.consecutive_skips) == 1


def test_skip_counters_saturate_instead_of_wrapping():
    big = jnp.asarray(np.iinfo(np.int32).max, jnp.int32)
    state = lossscale.NoOpLossScale().replace(skipped_steps=big, consecutive_skips=big)
    state = lossscale.update(state, jnp.asarray(False))
    assert int(state.skipped_steps) == np.iinfo(np.int32).max
    assert int(state.consecutive_skips) == np.iinfo(np.int32).max


def test_static_and_noop_scales_never_change():
    static, noop = lossscale.StaticLossScale(512), lossscale.NoOpLossScale()
    for finite in [False, True, False]:
        static = lossscale.update(static, jnp.asarray(finite))
        noop = lossscale.update(noop, jnp.asarray(finite))
    assert float(static.scale) == 512.0
    assert float(noop.scale) == 1.0


# -- states as pytrees -------------------------------------------------------------

KINDS = [
    lossscale.NoOpLossScale(),
    lossscale.StaticLossScale(3.0),
    lossscale.DynamicLossScale(
        scale=6.0,
        growth_interval=7,
        growth_factor=3.0,
        backoff_factor=0.25,
        min_scale=0.5,
        max_scale=96.0,
        hysteresis=2,
    ),
]


def settings_of(state):
    return state.get_config()


@pytest.mark.parametrize("state", KINDS, ids=lambda s: type(s).__name__)
def test_settings_survive_jit_tree_map_and_flatten(state):
    round_trips = [
        jax.jit(lambda s: s)(state),
        jax.tree.map(lambda x: x.copy(), state),
        jax.tree.unflatten(*reversed(jax.tree.flatten(state))),
        jax.tree_util.tree_map_with_path(lambda _, x: x, state),
        pickle.loads(pickle.dumps(state)),
        copy.deepcopy(state),
    ]
    for result in round_trips:
        assert type(result) is type(state)
        assert settings_of(result) == settings_of(state)
        assert jax.tree.structure(result) == jax.tree.structure(state)
        assert float(result.scale) == float(state.scale)


FIELDS = {
    "scale": jnp.float32,
    "counter": jnp.int32,
    "overflows_since_growth": jnp.int32,
    "skipped_steps": jnp.int32,
    "consecutive_skips": jnp.int32,
    "forward_overflows": jnp.int32,
    "stuck": jnp.bool_,
}


@pytest.mark.parametrize("state", KINDS, ids=lambda s: type(s).__name__)
def test_fields_are_scalar_arrays_with_explicit_dtypes(state):
    for name, dtype in FIELDS.items():
        if name in ("counter", "overflows_since_growth", "scale") and not isinstance(
            state, lossscale.DynamicLossScale
        ):
            continue
        value = getattr(state, name)
        assert isinstance(value, jax.Array), name
        assert value.shape == () and value.dtype == dtype, name
        assert not value.weak_type, name


@pytest.mark.parametrize("state", KINDS, ids=lambda s: type(s).__name__)
def test_leaves_are_named_scalars_of_explicit_dtypes(state):
    # Checkpoints and sharding rules read each leaf by its field's name.
    paths_and_leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    expected = {
        "skipped_steps": jnp.int32,
        "consecutive_skips": jnp.int32,
        "forward_overflows": jnp.int32,
        "stuck": jnp.bool_,
        "overflow_leaf": jnp.int32,
        "overflow_scale": jnp.float32,
    }
    if isinstance(state, lossscale.DynamicLossScale):
        expected = {
            "scale": jnp.float32,
            "counter": jnp.int32,
            "overflows_since_growth": jnp.int32,
            **expected,
        }
    assert [jax.tree_util.keystr(p) for p, _ in paths_and_leaves] == [
        f".{name}" for name in expected
    ]
    for (_path, leaf), dtype in zip(paths_and_leaves, expected.values(), strict=True):
        assert isinstance(leaf, jax.Array) and not leaf.weak_type
        assert leaf.dtype == dtype and leaf.shape == ()


@pytest.mark.parametrize("state", KINDS, ids=lambda s: type(s).__name__)
def test_jitted_update_compiles_once_and_keeps_structure(state):
    chex.clear_trace_counter()  # counted by source: parameters share it

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(state, finite):
        return lossscale.update(state, finite)

    for finite in [True, False, True, True, False]:
        new_state = step(state, jnp.asarray(finite))
        assert jax.tree.structure(new_state) == jax.tree.structure(state)
        for old, new in zip(
            jax.tree.leaves(state), jax.tree.leaves(new_state), strict=True
        ):
            assert (old.dtype, old.shape, old.weak_type) == (
                new.dtype,
                new.shape,
                new.weak_type,
            )
        state = new_state
    assert step._cache_size() == 1


@pytest.mark.parametrize("state", KINDS, ids=lambda s: type(s).__name__)
def test_update_gives_the_state_from_one_xla_cpu_kernel(state):
    # XLA:CPU compiles a kernel for each value a program gives, about 10 ms each:
    # the state's dozen scalars come from one.
    cpu = jax.devices("cpu")[0]
    state, flag = jax.device_put((state, jnp.asarray(False)), cpu)
    compiled = jax.jit(lossscale.update).lower(state, flag).compile()
    entry = compiled.as_text().split("ENTRY", 1)[1]
    assert entry.count(" fusion(") == 1, entry
    for finite in (False, True):  # and their values are `update`'s, bit for bit
        expected = lossscale.update(state, finite)
        for got, want in zip(
            jax.tree.leaves(compiled(state, jnp.asarray(finite))),
            jax.tree.leaves(expected),
            strict=True,
        ):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("state", KINDS, ids=lambda s: type(s).__name__)
def test_update_under_vmap_is_each_states_update(state):
    # A batch of states (one per seed, say): each moves as it would alone.
    flags = jnp.asarray([True, False, True, False])
    states = jax.tree.map(lambda x: jnp.stack([x] * 4), state)
    batched = jax.jit(jax.vmap(lossscale.update))(states, flags)
    for k, finite in enumerate(flags):
        alone = lossscale.update(state, finite)
        for got, want in zip(
            jax.tree.leaves(batched), jax.tree.leaves(alone), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(got)[k], want)


def test_unflatten_does_not_validate_leaves():
    # Transformations put placeholders in leaves; that must not trip validation.
    state = lossscale.DynamicLossScale()
    shapes = jax.eval_shape(lambda s: s, state)
    assert shapes.scale.dtype == jnp.float32
    nones = jax.tree.map(lambda _: object(), state)
    assert nones.growth_interval == 2000


def test_states_are_immutable():
    state = lossscale.DynamicLossScale()
    with pytest.raises(AttributeError, match="cannot assign to field 'scale'"):
        state.scale = jnp.float32(1.0)


def test_repr_names_leaves_and_settings():
    text = repr(lossscale.DynamicLossScale(scale=4.0, growth_interval=3))
    assert text.startswith("DynamicLossScale(scale=4.0, counter=0")
    assert "growth_interval=3" in text
    assert repr(lossscale.StaticLossScale(2)).endswith("value=2.0)")


def test_base_class_is_abstract():
    with pytest.raises(TypeError, match="abstract"):
        lossscale.LossScale()


# -- bad settings ------------------------------------------------------------------

BAD_DYNAMIC = [
    ({"growth_factor": 1.0}, ValueError, "growth_factor.*> 1"),
    ({"growth_factor": 0.5}, ValueError, "growth_factor.*> 1"),
    ({"growth_factor": 1 + 1e-9}, ValueError, "growth_factor"),
    ({"backoff_factor": 1.0}, ValueError, r"backoff_factor.*\(0, 1\)"),
    ({"backoff_factor": 0.0}, ValueError, "backoff_factor.*positive"),
    ({"backoff_factor": -0.5}, ValueError, "backoff_factor"),
    (
        {"min_scale": 4.0, "max_scale": 2.0, "scale": 3.0},
        ValueError,
        "min_scale.*<= `max_scale`",
    ),
    ({"min_scale": 0.0}, ValueError, "min_scale.*positive"),
    ({"min_scale": 1e-50}, ValueError, "min_scale.*float32"),
    ({"max_scale": float("inf")}, ValueError, "max_scale"),
    ({"max_scale": 1e39}, ValueError, "max_scale.*float32"),
    ({"scale": -1.0}, ValueError, "scale"),
    ({"scale": float("nan")}, ValueError, "scale"),
    ({"scale": 0.5}, ValueError, r"scale.*\[min_scale, max_scale\]"),
    ({"scale": 2.0**30}, ValueError, "scale"),
    ({"growth_interval": 0}, ValueError, "growth_interval.*>?1"),
    ({"growth_interval": -3}, ValueError, "growth_interval"),
    ({"growth_interval": 2.5}, TypeError, "growth_interval.*int"),
    ({"growth_interval": 2000.0}, TypeError, "growth_interval.*int"),
    ({"growth_interval": True}, TypeError, "growth_interval"),
    ({"growth_interval": 2**31}, ValueError, "growth_interval"),
    ({"hysteresis": 0}, ValueError, "hysteresis"),
    ({"hysteresis": 1.5}, TypeError, "hysteresis.*int"),
    ({"scale": "big"}, TypeError, "scale.*real number"),
    ({"growth_factor": None}, TypeError, "growth_factor.*real number"),
    ({"min_scale": True}, TypeError, "min_scale"),
    ({"max_scale": np.array([1.0, 2.0])}, TypeError, "max_scale"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD_DYNAMIC)
def test_bad_dynamic_settings_raise_naming_the_argument(kwargs, error, message):
    with pytest.raises(error, match=message):
        lossscale.DynamicLossScale(**kwargs)


@pytest.mark.parametrize(
    ("scale", "error"),
    [
        (0, ValueError),
        (-2.0, ValueError),
        (float("inf"), ValueError),
        (float("nan"), ValueError),
        (jnp.float32(jnp.nan), ValueError),
        (np.array(0.0), ValueError),
        (1e40, ValueError),
        ("8", TypeError),
        (None, TypeError),
        (False, TypeError),
    ],
)
def test_bad_static_scale_raises(scale, error):
    with pytest.raises(error, match="`value`"):
        lossscale.StaticLossScale(scale)


def test_numpy_and_jax_scalars_are_accepted_as_settings():
    state = lossscale.DynamicLossScale(
        scale=np.float64(8.0),
        growth_interval=np.int64(5),
        min_scale=jnp.float32(0.5),
    )
    assert (state.growth_interval, state.min_scale) == (5, 0.5)
    assert isinstance(state.growth_interval, int)


def python_float_error(value, **settings):
    """The error `DynamicLossScale` raises for the Python float `value`."""
    with pytest.raises((TypeError, ValueError)) as info:
        lossscale.DynamicLossScale(scale=value, **settings)
    return type(info.value), str(info.value)


ARRAY_TYPES = {
    "jax": lambda v: jnp.asarray(v, jnp.float32),
    # Converted by XLA: numpy would warn when 1e9 overflows float16.
    "jax float16": lambda v: jnp.asarray(v, jnp.float32).astype(jnp.float16),
    "numpy 0-d": lambda v: np.asarray(v, np.float64),
    "numpy scalar": np.float32,
}


@pytest.mark.parametrize("make", ARRAY_TYPES.values(), ids=ARRAY_TYPES.keys())
@pytest.mark.parametrize("value", [float("nan"), 0.0, -1.0, float("inf"), 1e9, 0.5])
def test_a_concrete_array_scale_is_refused_as_the_same_python_float(make, value):
    # Issue 33: arrays skipped the check, so NaN, 0 or 1e9 made a state.
    # (float16 rounds 1e9 to inf: refused as positive_float32 refuses inf.)
    expected = python_float_error(float(np.asarray(make(value), np.float64)))
    with pytest.raises(expected[0]) as info:
        lossscale.DynamicLossScale(scale=make(value))
    assert str(info.value) == expected[1]


def test_a_stacked_array_scale_is_checked_element_by_element():
    counters = {
        name: jnp.zeros(8, jnp.int32)
        for name in ("skipped_steps", "consecutive_skips", "forward_overflows")
    }
    good = lossscale.DynamicLossScale(scale=jnp.full(8, 2.0**10), **counters)
    assert good.scale.shape == (8,)
    for stacked in (jnp.array([4.0, jnp.nan]), np.array([4.0, 0.0])):
        with pytest.raises(ValueError, match="`scale` must be positive and finite"):
            lossscale.DynamicLossScale(scale=stacked)
    with pytest.raises(ValueError, match=r"within \[min_scale, max_scale\]"):
        lossscale.DynamicLossScale(scale=jnp.array([4.0, 1e9]))
    with pytest.raises(TypeError, match="`scale` must be a real number.*bool"):
        lossscale.DynamicLossScale(scale=jnp.array([True, True]))


def test_a_traced_scale_is_left_to_the_step():
    # It cannot be read while tracing; `update` and `metrics` report what it does.
    @jax.jit
    def build(scale):
        return lossscale.DynamicLossScale(scale=scale).scale

    assert np.isnan(build(jnp.float32(jnp.nan)))
    assert float(build(jnp.float32(8.0))) == 8.0


def test_a_misspelt_argument_names_the_field_it_resembles():
    with pytest.raises(
        TypeError, match="no field `growth_intervall`.*`growth_interval`"
    ):
        lossscale.DynamicLossScale(growth_intervall=10)
    with pytest.raises(TypeError, match="`scale` is a property `NoOpLossScale`"):
        lossscale.NoOpLossScale(scale=2.0)


def test_too_many_positional_values_say_which_one_a_kind_takes():
    # Python's own message counts `self`: "takes 1 positional argument but 2...".
    with pytest.raises(TypeError, match="`NoOpLossScale` takes no argument by pos"):
        lossscale.NoOpLossScale(1.0)
    with pytest.raises(TypeError, match="`StaticLossScale` takes `value` by position"):
        lossscale.StaticLossScale(8.0, 2.0)


@pytest.mark.parametrize(
    "build, error, match",
    [
        (
            lambda: lossscale.wrap(optax.sgd(0.1), lossscale.DynamicLossScale),
            TypeError,
            r"the class `DynamicLossScale`; pass a state, an instance",
        ),
        (
            lambda: lossscale.wrap(optax.sgd(0.1), "static"),
            ValueError,
            r"a fixed scale is a number",
        ),
    ],
)
def test_a_spec_that_is_nearly_right_says_what_to_write(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_traced_setting_gets_a_clear_error():
    with pytest.raises(TypeError, match="concrete number.*static"):
        jax.jit(lambda s: lossscale.StaticLossScale(s))(jnp.float32(2.0))


@pytest.mark.parametrize(
    ("finite", "error", "message"),
    [
        (jnp.ones([2], jnp.bool_), ValueError, "scalar"),
        (jnp.float32(1.0), TypeError, "boolean"),
        (1, TypeError, "boolean scalar"),
        ("yes", TypeError, "boolean scalar"),
    ],
)
def test_update_rejects_bad_predicates(finite, error, message):
    with pytest.raises(error, match=message):
        lossscale.update(lossscale.DynamicLossScale(), finite)


def test_update_rejects_non_states():
    with pytest.raises(TypeError, match="get_loss_scale"):
        lossscale.update({"scale": jnp.float32(1)}, jnp.asarray(True))


def test_update_accepts_python_bools():
    state = lossscale.update(lossscale.DynamicLossScale(scale=4.0), False)
    assert float(state.scale) == 2.0


@pytest.mark.parametrize(
    "build, name",
    [
        (lambda: lossscale.StaticLossScale(10**400), "value"),
        (lambda: lossscale.wrap(optax.sgd(0.1), 10**400), "value"),
        (lambda: lossscale.DynamicLossScale(max_scale=10**400), "max_scale"),
        (
            lambda: lossscale.LossScale.from_config(
                json.loads('{"kind": "static", "value": 1' + "0" * 400 + "}")
            ),
            "value",
        ),
    ],
)
def test_numbers_beyond_any_float_are_a_value_error_naming_the_setting(build, name):
    # Python's float() raises OverflowError on them; the message stays short.
    with pytest.raises(ValueError, match=f"`{name}` must be positive and finite") as e:
        build()
    assert "chars)" in str(e.value) and len(str(e.value)) < 300


@pytest.mark.parametrize(
    "build, name",
    [
        (lambda: lossscale.DynamicLossScale(min_scale=1e-44, scale=1.0), "min_scale"),
        (lambda: lossscale.DynamicLossScale(1e-40, min_scale=1e-45), "min_scale"),
        (lambda: lossscale.DynamicLossScale(backoff_factor=2**-140), "backoff_factor"),
        (lambda: lossscale.StaticLossScale(1e-40), "value"),
        (lambda: lossscale.wrap(optax.sgd(0.1), 2.0**-130), "value"),
    ],
)
def test_subnormal_float32_settings_are_refused(build, name):
    with pytest.raises(ValueError, match=f"`{name}` must be a normal float32"):
        build()


def test_the_lowest_min_scale_holds_through_jitted_back_offs():
    # 2**-126, the smallest normal float32: the back-off's product (2**-127) is
    # subnormal, which XLA:CPU flushes to zero; the scale stays at `min_scale`.
    state = lossscale.DynamicLossScale(2.0**-120, min_scale=2.0**-126)
    for _ in range(10):
        state = jitted_update(state, jnp.asarray(False))
    assert float(state.scale) == 2.0**-126, float(state.scale)
    assert float(jnp.ones([], jnp.float32) / state.scale) == 2.0**126


@pytest.mark.parametrize(
    ("grads_finite", "loss_finite", "error", "hint"),
    [
        ({"w": jnp.ones(2)}, True, TypeError, "lossscale.all_finite(grads)"),
        (jnp.isfinite(jnp.ones(3)), True, ValueError, "lossscale.all_finite(grads)"),
        (True, jnp.float32(0.5), TypeError, "jnp.isfinite(loss)"),
        (True, 0.5, TypeError, "jnp.isfinite(loss)"),
    ],
    ids=["grads", "isfinite_per_element", "loss_array", "loss_float"],
)
def test_update_given_gradients_or_a_loss_says_how_to_compute_the_flag(
    grads_finite, loss_finite, error, hint
):
    with pytest.raises(error, match=re.escape(hint)):
        lossscale.update(lossscale.DynamicLossScale(), grads_finite, loss_finite)
