"""The base class (`_src/state/kind.py`, `kind_fields.py`, `kind_validation.py`):
user-defined kinds work wherever the built-in kinds do, and mistakes are refused.

TF contrib's test manager (+1 after a finite step, -1 after a non-finite one) and a
richer kind with settings, an int field, a shaped field and a lower bound, checked
against a pure-Python model, through every public entry point.
"""

import copy
import json
import pickle

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import DEVICES
from helpers import init_params
from helpers import linen_state
from helpers import linen_step
from helpers import per_device_grads
from helpers import restore
from helpers import save
from helpers import stacked
from helpers import tree_equal
from hypothesis.stateful import RuleBasedStateMachine
from hypothesis.stateful import initialize
from hypothesis.stateful import invariant
from hypothesis.stateful import rule
from jax.sharding import PartitionSpec as P

import lossscale
import lossscale.flax


class AddOneLossScale(lossscale.LossScale, kind="tests.add_one"):
    """TF contrib's `SimpleLossScaleManager` test manager."""

    scale: jax.Array = lossscale.field(dtype=jnp.float32, default=8.0, kw_only=False)

    def rule(self, grads_finite):
        return self.replace(scale=self.scale + jnp.where(grads_finite, 1.0, -1.0))


class DoublingLossScale(lossscale.LossScale):
    """Doubles after `period` finite steps in a row, halves on overflow, within
    [floor, cap]; remembers whether the last three rule steps were finite."""

    scale: jax.Array = lossscale.field(dtype=jnp.float32, default=64.0, kw_only=False)
    finite_run: jax.Array = lossscale.field(dtype=jnp.int32, default=0)
    history: jax.Array = lossscale.field(dtype=jnp.bool_, shape=(3,), default=False)
    period: int = lossscale.field(static=True, default=2)
    floor: float = lossscale.field(static=True, default=1.0)
    cap: float = lossscale.field(static=True, default=2.0**10)

    @property
    def min_scale(self):
        return self.floor

    def rule(self, grads_finite):
        run = jnp.where(grads_finite, self.finite_run + 1, 0)
        grow = run >= self.period
        scale = jnp.where(
            grads_finite,
            jnp.where(grow, jnp.minimum(self.scale * 2, self.cap), self.scale),
            jnp.maximum(self.scale / 2, self.floor),
        )
        return self.replace(
            scale=scale,
            finite_run=jnp.where(grow, 0, run),
            history=jnp.concatenate([self.history[1:], grads_finite[None]]),
        )


class ReferenceDoubling:
    """The same rule, plus the library's counters, in plain Python."""

    def __init__(self, initial_scale=64.0, period=2, floor=1.0, cap=2.0**10):
        self.scale, self.period, self.floor, self.cap = (
            initial_scale,
            period,
            floor,
            cap,
        )
        self.finite_run, self.history = 0, [False] * 3
        self.skipped = self.consecutive = self.forward = 0
        self.stuck = False

    def step(self, finite, loss_finite=True):
        self.stuck = loss_finite and not finite and self.scale <= self.floor
        if loss_finite and finite:
            self.consecutive = 0
        else:
            self.skipped += 1
            self.consecutive += 1
        if not loss_finite:
            self.forward += 1
            return
        self.history = self.history[1:] + [finite]
        if finite:
            self.finite_run += 1
            if self.finite_run >= self.period:
                self.scale, self.finite_run = min(self.scale * 2, self.cap), 0
        else:
            self.finite_run = 0
            self.scale = max(self.scale / 2, self.floor)


def contrib_gradients(opt_state_or_scale):
    # TF contrib's test feeds the gradients nan, inf, 0.1 to SGD(1): here they are
    # gradients of the scaled loss, so multiplied by the current scale.
    return [jnp.float32(jnp.nan), jnp.float32(jnp.inf), jnp.float32(0.1)]


EXPECTED_SCALES = [7.0, 6.0, 7.0]  # 8 - 1, 8 - 2, 8 - 2 + 1
EXPECTED_X = [1.0, 1.0, 0.9]


def test_tf_contrib_manager_with_wrap():
    tx = lossscale.wrap(optax.sgd(1.0), AddOneLossScale())
    x = jnp.float32(1.0)
    opt_state = tx.init(x)
    step = jax.jit(tx.update)
    scales, xs = [], []
    for grad in contrib_gradients(opt_state):
        scaled = grad * lossscale.get_loss_scale(opt_state).scale
        updates, opt_state = step(scaled, opt_state, x)
        x = optax.apply_updates(x, updates)
        scales.append(float(lossscale.metrics(opt_state)["loss_scale"]))
        xs.append(float(x))
    assert scales == EXPECTED_SCALES
    np.testing.assert_allclose(xs, EXPECTED_X, rtol=1e-6)
    assert int(lossscale.metrics(opt_state)["skipped_steps"]) == 2


class Scalar(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.float32(1.0))


def test_tf_contrib_manager_with_apply_gradients_and_train_states():
    tx = optax.sgd(1.0)
    x, opt_state = jnp.float32(1.0), tx.init(jnp.float32(1.0))
    loss_scale = AddOneLossScale()
    linen = lossscale.flax.TrainState.create(
        apply_fn=None, params=x, tx=tx, loss_scale=AddOneLossScale()
    )
    model = Scalar()
    optimizer = lossscale.flax.Optimizer(
        model, tx, wrt=nnx.Param, loss_scale=AddOneLossScale()
    )
    apply = jax.jit(
        lambda g, x, o, s: lossscale.apply_gradients(
            tx, grads=g, params=x, opt_state=o, loss_scale=s
        )
    )
    for grad, scale, expected in zip(
        contrib_gradients(None), EXPECTED_SCALES, EXPECTED_X, strict=True
    ):
        x, opt_state, loss_scale = apply(
            grad * loss_scale.scale, x, opt_state, loss_scale
        )
        linen = linen.apply_gradients(grads=grad * linen.loss_scale.scale)
        grads = nnx.grad(
            lambda m, g=grad: lossscale.scale_loss(m.w[...] * g, optimizer)
        )(model)
        optimizer.update(model, grads)
        for path_x, path_scale in [
            (x, loss_scale.scale),
            (linen.params, linen.loss_scale.scale),
            (model.w[...], optimizer.loss_scale.scale),
        ]:
            assert float(path_scale) == scale
            np.testing.assert_allclose(float(path_x), expected, rtol=1e-6)
    assert int(linen.step) == 1 and int(optimizer.step[...]) == 1


class DoublingMachine(RuleBasedStateMachine):
    """Random steps through `lossscale.update` under jit, against the model."""

    @initialize(initial=st.sampled_from([1.0, 4.0, 64.0]), period=st.integers(1, 3))
    def start(self, initial, period):
        self.state = DoublingLossScale(initial, period=period, cap=128.0)
        self.reference = ReferenceDoubling(initial, period=period, cap=128.0)

    @rule(finite=st.booleans(), loss_finite=st.sampled_from([True, True, False]))
    def step(self, finite, loss_finite):
        self.state = JITTED_UPDATE(
            self.state, jnp.asarray(finite), jnp.asarray(loss_finite)
        )
        self.reference.step(finite, loss_finite)

    @invariant()
    def same_as_reference(self):
        state, ref = self.state, self.reference
        assert float(state.scale) == ref.scale
        assert int(state.finite_run) == ref.finite_run
        assert np.asarray(state.history).tolist() == ref.history
        assert int(state.skipped_steps) == ref.skipped
        assert int(state.consecutive_skips) == ref.consecutive
        assert int(state.forward_overflows) == ref.forward
        assert bool(state.stuck) == ref.stuck


JITTED_UPDATE = jax.jit(lossscale.update)
TestDoublingMachine = DoublingMachine.TestCase


def test_a_custom_kind_compiles_once_and_keeps_its_layout():
    chex.clear_trace_counter()  # counted by source: parameters share it

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(state, finite):
        return lossscale.update(state, finite)

    state = DoublingLossScale()
    for finite in [True, False, True, True, False, True]:
        new = step(state, jnp.asarray(finite))
        assert jax.tree.structure(new) == jax.tree.structure(state)
        for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(state), strict=True):
            assert (a.dtype, a.shape, a.weak_type) == (b.dtype, b.shape, b.weak_type)
        state = new
    assert step._cache_size() == 1


@pytest.mark.parametrize(
    "state", [AddOneLossScale(3.0), DoublingLossScale(8.0, period=3)]
)
def test_custom_kinds_round_trip_config_pickle_and_copies(state):
    state = lossscale.update(state, jnp.asarray(False))
    saved = json.loads(json.dumps(state.get_config()))
    rebuilt = lossscale.LossScale.from_config(saved)
    assert type(rebuilt) is type(state) and rebuilt.get_config() == saved
    assert type(state).from_config(saved).get_config() == saved
    lossscale.checkpoints.check_config(saved, state)
    for copied in [
        pickle.loads(pickle.dumps(state)),
        copy.deepcopy(state),
        jax.tree.map(lambda x: x, state),
        jax.jit(lambda s: s)(state),
    ]:
        assert copied == state and type(copied) is type(state)


def test_check_config_tells_custom_settings_apart():
    saved = DoublingLossScale(period=2).get_config()
    with pytest.raises(ValueError, match="period: checkpoint 2, code 3"):
        lossscale.checkpoints.check_config(saved, DoublingLossScale(period=3))
    with pytest.raises(ValueError, match="kind"):
        lossscale.checkpoints.check_config(saved, AddOneLossScale())


def test_from_config_of_one_kind_refuses_another():
    with pytest.raises(ValueError, match="got a config of kind 'static'"):
        AddOneLossScale.from_config(lossscale.StaticLossScale(2).get_config())


def test_metrics_and_lookup_read_a_custom_kind():
    tx = optax.chain(optax.clip(1.0), lossscale.wrap(optax.sgd(0.1), AddOneLossScale()))
    opt_state = tx.init(jnp.zeros(2))
    found = lossscale.get_loss_scale(opt_state)
    assert isinstance(found, AddOneLossScale)
    _, opt_state = jax.jit(tx.update)(jnp.full(2, jnp.nan), opt_state, jnp.zeros(2))
    metrics = lossscale.metrics(opt_state)
    assert float(metrics["loss_scale"]) == 7.0
    assert int(metrics["backward_overflows"]) == 1
    assert not bool(metrics["last_finite"])


def test_stuck_uses_the_kinds_min_scale():
    state = DoublingLossScale(2.0, floor=1.0)
    state = lossscale.update(state, jnp.asarray(False))  # 2 -> 1: not stuck yet
    assert not bool(state.stuck) and float(state.scale) == 1.0
    state = lossscale.update(state, jnp.asarray(False))  # at the floor: stuck
    assert bool(state.stuck)
    # A kind that does not say how low it goes is stuck once its scale is 0.
    state = lossscale.update(AddOneLossScale(1.0), jnp.asarray(False))
    assert not bool(state.stuck) and float(state.scale) == 0.0
    assert bool(lossscale.update(state, jnp.asarray(False)).stuck)


def test_orbax_resumes_a_custom_kind_bit_identically(tmp_path):
    def run(state, steps):
        for step in steps:
            rng = np.random.default_rng(step)
            x = jnp.asarray(rng.random((32, 64)), jnp.float32)
            x = x * 1e5 if step % 5 == 2 else x  # overflows float16: skipped
            state, _ = linen_step(state, x, jnp.asarray(rng.integers(0, 10, 32)))
        return state

    state = run(linen_state(DoublingLossScale(2.0**12, period=3)), range(10))
    save(tmp_path, 10, state)
    target = linen_state(DoublingLossScale(2.0**12, period=3))
    resumed = run(restore(tmp_path, 10, target), range(10, 20))
    state = run(state, range(10, 20))
    assert int(state.loss_scale.skipped_steps) == 4
    assert resumed.loss_scale == state.loss_scale
    assert tree_equal(jax.tree.leaves(resumed), jax.tree.leaves(state))


@pytest.mark.skipif(len(DEVICES) < 8, reason="needs 8 CPU devices")
def test_shard_map_with_axis_name_agrees_for_a_custom_kind(mesh):
    tx = lossscale.wrap(optax.sgd(0.1), AddOneLossScale(), axis_name="data")
    params = stacked(init_params())
    opt_state = stacked(tx.init(init_params()))

    def local_step(grads, opt_state, params):
        squeeze = lambda t: jax.tree.map(lambda x: x[0], t)  # noqa: E731
        grads, opt_state, params = squeeze(grads), squeeze(opt_state), squeeze(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return jax.tree.map(lambda x: x[None], (params, opt_state))

    step = jax.jit(
        jax.shard_map(local_step, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    )
    _, new_opt_state = step(per_device_grads(5), opt_state, params)
    np.testing.assert_array_equal(new_opt_state.loss_scale.scale, np.full(8, 7.0))
    np.testing.assert_array_equal(new_opt_state.loss_scale.skipped_steps, np.ones(8))


# -- states compare by value ---------------------------------------------------


@pytest.mark.parametrize(
    "state",
    [
        lossscale.NoOpLossScale(),
        lossscale.StaticLossScale(2.0),
        lossscale.DynamicLossScale(),
        DoublingLossScale(),
    ],
    ids=lambda s: type(s).__name__,
)
def test_states_compare_by_value(state):
    assert jax.tree.map(lambda x: x, state) == state
    assert pickle.loads(pickle.dumps(state)) == state
    stepped = lossscale.update(state, jnp.asarray(False))
    assert stepped != state  # the counters moved
    assert state != AddOneLossScale()
    assert (state == 1.0) is False


def test_states_of_other_settings_or_values_compare_unequal():
    assert lossscale.StaticLossScale(2.0) != lossscale.StaticLossScale(4.0)
    assert lossscale.DynamicLossScale() != lossscale.DynamicLossScale(hysteresis=2)
    assert lossscale.DynamicLossScale() != lossscale.DynamicLossScale(8.0)
    assert lossscale.StaticLossScale(1.0) != lossscale.NoOpLossScale()


def test_comparing_traced_states_says_what_to_do_instead():
    with pytest.raises(TypeError, match="concrete arrays"):
        jax.jit(lambda a, b: a == b)(AddOneLossScale(), AddOneLossScale())


# -- declaring a kind: mistakes get clear errors -------------------------------


def test_replace_checks_names_dtypes_and_shapes():
    state = DoublingLossScale()
    with pytest.raises(TypeError, match="array fields.*'nope'"):
        state.replace(nope=1)
    with pytest.raises(TypeError, match="period"):
        state.replace(period=3)
    with pytest.raises(TypeError, match="finite_run` holds int32.*float32"):
        state.replace(finite_run=jnp.float32(1.0))
    with pytest.raises(ValueError, match=r"history` has shape \(3,\)"):
        state.replace(history=jnp.zeros(4, bool))
    assert int(state.replace(finite_run=2).finite_run) == 2  # a Python int is cast


def test_a_rule_must_return_the_same_kind_and_settings():
    class Wrong(lossscale.LossScale):
        scale: jax.Array = lossscale.field(dtype=jnp.float32, default=1.0)

        def rule(self, grads_finite):
            return lossscale.StaticLossScale(2.0)

    with pytest.raises(TypeError, match="`Wrong.rule` must return a `Wrong`"):
        lossscale.update(Wrong(), jnp.asarray(True))


def test_a_rule_must_keep_each_fields_shape():
    # Through `replace`, refused where it is made; through the constructor (which
    # takes a leading batch shape), refused by `update`.
    class Widening(lossscale.LossScale):
        scale: jax.Array = lossscale.field(dtype=jnp.float32, default=1.0)
        run: jax.Array = lossscale.field(dtype=jnp.int32, default=0)

        def rule(self, grads_finite):
            return self.replace(scale=jnp.full((3,), self.scale))

    class Rebuilding(Widening):
        def rule(self, grads_finite):
            return Rebuilding(scale=self.scale, run=jnp.zeros(3, jnp.int32))

    with pytest.raises(ValueError, match=r"field `scale` has shape \(\), got.*\(3,\)"):
        lossscale.update(Widening(), jnp.asarray(True))
    with pytest.raises(TypeError, match=r"changed field `run` from int32\[\] to"):
        lossscale.update(Rebuilding(), jnp.asarray(True))


def test_a_custom_init_is_refused_at_class_creation():
    with pytest.raises(TypeError, match="defines `__init__`.*__post_init__"):

        class Forgetful(lossscale.LossScale):
            scale: jax.Array = lossscale.field(dtype=jnp.float32, default=1.0)

            def __init__(self):
                pass

            def rule(self, grads_finite):
                return self


def test_an_array_field_without_a_value_says_so():
    class Empty(lossscale.LossScale):
        scale: jax.Array = lossscale.field(dtype=jnp.float32, default=None)

        def rule(self, grads_finite):
            return self

    with pytest.raises(TypeError, match="field `scale` has no value"):
        Empty()
    with pytest.raises(TypeError, match="missing.*'scale'"):
        type(
            "NoDefault",
            (Empty,),
            {
                "__annotations__": {"scale": jax.Array},
                "scale": lossscale.field(dtype=jnp.float32),
            },
        )()


def test_a_kind_without_scale_or_rule_is_refused_at_class_creation():
    with pytest.raises(TypeError, match="must define `rule"):

        class NoRule(lossscale.LossScale):
            scale: jax.Array = lossscale.field(dtype=jnp.float32, default=1.0)

    with pytest.raises(TypeError, match="must define `scale`"):

        class NoScale(lossscale.LossScale):
            def rule(self, grads_finite):
                return self


def _kind(annotations, body):
    body = {"rule": lambda self, grads_finite: self, **body}
    return type("Bad", (lossscale.LossScale,), {"__annotations__": annotations, **body})


@pytest.mark.parametrize(
    "annotations, body, match",
    [
        (
            {"scale": jax.Array, "skipped_steps": jax.Array},
            {
                "scale": lossscale.field(dtype=jnp.float32, default=1.0),
                "skipped_steps": lossscale.field(dtype=jnp.float32, default=0.0),
            },
            "a counter every state has",
        ),
        (
            {"scale": jax.Array, "kind": str},
            {"scale": lossscale.field(dtype=jnp.float32, default=1.0), "kind": "x"},
            "without `lossscale.field`",
        ),
        (
            {"scale": jax.Array, "kind": str},
            {
                "scale": lossscale.field(dtype=jnp.float32, default=1.0),
                "kind": lossscale.field(static=True, default="x"),
            },
            "a name `LossScale` uses",
        ),
        (
            {"scale": jax.Array, "period": int},
            {"scale": lossscale.field(dtype=jnp.float32, default=1.0), "period": 2},
            r"`Bad.period`.*lossscale.field\(static=True",
        ),
    ],
)
def test_declaration_mistakes_are_refused(annotations, body, match):
    with pytest.raises(TypeError, match=match):
        _kind(annotations, body)


def test_settings_must_be_static_python_values():
    class Holder(lossscale.LossScale):
        scale: jax.Array = lossscale.field(dtype=jnp.float32, default=1.0)
        value: object = lossscale.field(static=True, default=None)

        def rule(self, grads_finite):
            return self

    with pytest.raises(TypeError, match="setting `value` must be a Python value"):
        Holder(value=jnp.float32(1.0))
    with pytest.raises(TypeError, match="number, string, bool, None or a tuple"):
        Holder(value={1: 2})
    assert Holder(value=(1, 2)).value == (1, 2)
    assert Holder(value=[1, [2.5, "a"]]).value == (1, (2.5, "a"))  # JSON's lists


def test_a_list_default_of_a_setting_becomes_the_tuple_a_list_value_does():
    # Issue 33: dataclasses refused it with "use default_factory", which
    # `lossscale.field` does not take. A setting is immutable, so the list is
    # stored as a tuple, as a list given to the constructor or read from JSON is.
    class Milestones(lossscale.LossScale, kind="tests.milestones"):
        scale: jax.Array = lossscale.field(dtype=jnp.float32, default=1.0)
        steps: tuple = lossscale.field(static=True, default=[10, [20, 30]])

        def rule(self, grads_finite):
            return self

    assert Milestones().steps == (10, (20, 30))
    assert Milestones(steps=[10, [20, 30]]) == Milestones()
    saved = json.loads(json.dumps(Milestones().get_config()))
    assert lossscale.LossScale.from_config(saved) == Milestones()
    assert jax.tree.structure(Milestones()) == jax.tree.structure(
        Milestones(steps=(10, (20, 30)))
    )


def test_a_setting_default_that_no_setting_can_hold_is_refused_at_the_field():
    with pytest.raises(TypeError, match=r"`field\(static=True\)`: setting `default`"):
        lossscale.field(static=True, default={"a": 1})
    with pytest.raises(TypeError, match="must be a Python value"):
        lossscale.field(static=True, default=np.float32(1.0))


def test_a_field_without_an_annotation_says_to_annotate_it():
    # dataclasses' own message ("is a field but has no type annotation") does
    # not say which annotation.
    with pytest.raises(TypeError, match=r"write `scale: jax.Array = lossscale.field"):
        _kind({}, {"scale": lossscale.field(dtype=jnp.float32, default=1.0)})
    with pytest.raises(TypeError, match=r"write `floor: float = lossscale.field"):
        _kind(
            {"scale": jax.Array},
            {
                "scale": lossscale.field(dtype=jnp.float32, default=1.0),
                "floor": lossscale.field(static=True, default=1.0),
            },
        )


def test_fields_need_a_numeric_dtype_jax_keeps_and_a_shape_tuple():
    with pytest.raises(TypeError, match="numeric or boolean"):
        lossscale.field(dtype=jnp.dtype("U3"))
    with pytest.raises(TypeError, match="tuple of non-negative ints"):
        lossscale.field(dtype=jnp.float32, shape=[3])
    with pytest.raises(TypeError, match="needs `dtype=`"):
        lossscale.field()
    with pytest.raises(TypeError, match="takes no `dtype`"):
        lossscale.field(static=True, dtype=jnp.int32)
    if not jax.config.jax_enable_x64:
        # `int` is int64, which JAX stores as int32: a cast could never fix it.
        with pytest.raises(TypeError, match=r"stores int64 as int32.*jnp.int32"):
            lossscale.field(dtype=int)
    with pytest.raises(TypeError, match="default.*Python number"):
        lossscale.field(dtype=jnp.float32, default=jnp.ones(2))


@pytest.mark.parametrize(
    "body, match",
    [
        (
            {
                "scale": lossscale.field(dtype=jnp.float32, shape=(2,), default=1.0),
            },
            r"scale` must be a float32 scalar array, got a field of float32 and shape",
        ),
        ({"scale": property(lambda self: 4.0)}, "scale` must be a float32 scalar"),
        (
            {
                "scale": lossscale.field(dtype=jnp.float32, default=1.0),
                "min_scale": property(lambda self: self.scale),
            },
            "min_scale` must be a static Python float",
        ),
    ],
)
def test_scale_and_bounds_are_checked_where_declared_or_built(body, match):
    is_field = not isinstance(body["scale"], property)
    with pytest.raises(TypeError, match=match):
        _kind({"scale": jax.Array} if is_field else {}, body)()


def test_private_and_public_settings_round_trip_apart():
    class Floors(lossscale.LossScale, kind="tests.floors"):
        scale: jax.Array = lossscale.field(dtype=jnp.float32, default=1.0)
        _floor: float = lossscale.field(static=True, default=1.0)
        floor: float = lossscale.field(static=True, default=2.0)
        milestones: tuple = lossscale.field(static=True, default=())

        def rule(self, grads_finite):
            return self

    state = Floors(_floor=3.0, floor=4.0, milestones=(10, 20))
    saved = json.loads(json.dumps(state.get_config()))
    assert saved == {
        "kind": "tests.floors",
        "_floor": 3.0,
        "floor": 4.0,
        "milestones": [10, 20],
    }
    assert lossscale.LossScale.from_config(saved) == state


def test_kinds_made_by_one_function_are_not_confused():
    def make(step):
        class Stepper(lossscale.LossScale):
            scale: jax.Array = lossscale.field(dtype=jnp.float32, default=8.0)

            def rule(self, grads_finite):
                return self.replace(scale=self.scale + step)

        return Stepper

    up, down = make(1.0), make(-1.0)
    for kind in (up, down):
        with pytest.raises(ValueError, match="defined inside a function.*kind="):
            lossscale.LossScale.from_config(kind().get_config())


def test_a_nan_scale_is_stuck_and_a_zero_scale_keeps_nan_out():
    class Broken(lossscale.LossScale):
        scale: jax.Array = lossscale.field(dtype=jnp.float32, default=1.0)
        min_scale = 1.0

        def rule(self, grads_finite):
            return self  # never moves: the test sets the scale

    state = lossscale.update(Broken(scale=jnp.nan), jnp.asarray(False))
    assert bool(state.stuck)
    tx = lossscale.wrap(optax.sgd(0.1), Broken(scale=0.0))
    params = jnp.ones(3)
    grads = jnp.zeros(3)  # the gradients of a loss scaled by 0
    updates, opt_state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert np.isfinite(np.asarray(optax.apply_updates(params, updates))).all()
    assert int(opt_state.loss_scale.skipped_steps) == 1


def test_a_kind_name_cannot_be_taken_twice():
    with pytest.raises(ValueError, match="'dynamic' is taken by"):
        type("Other", (lossscale.StaticLossScale,), {}, kind="dynamic")


# -- sparse gradients ----------------------------------------------------------


def test_sparse_gradients_are_refused_before_a_duplicate_overflow_can_hide():
    from jax.experimental import sparse

    # Two float16 entries of 64000 at one index: each is finite, their sum is not.
    grads = {
        "w": sparse.BCOO(
            (jnp.array([64000.0, 64000.0], jnp.float16), jnp.array([[0], [0]])),
            shape=(4,),
        )
    }
    assert not np.isfinite(np.asarray(grads["w"].todense())).all()
    params = {"w": jnp.zeros(4, jnp.float16)}
    tx = lossscale.wrap(optax.sgd(0.1), 1.0)
    calls = [
        lambda: tx.update(grads, tx.init(params), params),
        lambda: lossscale.unscale_grads(grads, lossscale.NoOpLossScale()),
        lambda: lossscale.all_finite(grads),
        lambda: lossscale.apply_gradients(
            optax.sgd(0.1),
            grads=grads,
            params=params,
            opt_state=optax.sgd(0.1).init(params),
            loss_scale=lossscale.NoOpLossScale(),
        ),
        lambda: lossscale.diagnostics.grad_stats(grads),
    ]
    for call in calls:
        with pytest.raises(TypeError, match=r"sparse `BCOO` at \['w'\].*todense"):
            call()
