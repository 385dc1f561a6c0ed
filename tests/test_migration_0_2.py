"""lossscale 0.2's documented API on 0.3: each row of `docs/migration/lossscale_0_2.md`.

Where a name changed, 0.2's spelling either works and warns (`DeprecationWarning`
naming the new spelling, attributed to the caller's line), or is an error naming the
new spelling; the page says which, per row.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_equal

import lossscale

NEW = "lossscale 0.2's spelling"


def warns_here(match):
    """`pytest.warns` that also checks the warning points at this file."""

    class Check:
        def __enter__(self):
            self.context = pytest.warns(DeprecationWarning, match=match)
            self.record = self.context.__enter__()
            return self.record

        def __exit__(self, *exc):
            result = self.context.__exit__(*exc)
            if exc[0] is None:
                files = [w.filename for w in self.record]
                assert files and all(f == __file__ for f in files), files
            return result

    return Check()


# -- aliases that warn -------------------------------------------------------------


def test_dynamic_initial_scale_is_scale_with_a_warning():
    with warns_here(r"DynamicLossScale\(initial_scale=...\)` is .*\(scale=...\)"):
        old = lossscale.DynamicLossScale(initial_scale=256.0, growth_interval=3)
    assert old == lossscale.DynamicLossScale(scale=256.0, growth_interval=3)


def test_dynamic_settings_by_position_as_0_2_ordered_them_warn():
    # 0.2: DynamicLossScale(initial_scale, growth_interval, growth_factor,
    # backoff_factor, min_scale, max_scale, hysteresis).
    with warns_here("growth_interval=..., growth_factor=..., backoff_factor=..."):
        old = lossscale.DynamicLossScale(8.0, 3, 4.0, 0.25, 2.0, 64.0, 2)
    new = lossscale.DynamicLossScale(
        scale=8.0,
        growth_interval=3,
        growth_factor=4.0,
        backoff_factor=0.25,
        min_scale=2.0,
        max_scale=64.0,
        hysteresis=2,
    )
    assert old == new and old.get_config() == new.get_config()


def test_a_position_also_given_by_keyword_is_not_guessed():
    with pytest.raises(TypeError, match="positional"):
        lossscale.DynamicLossScale(8.0, 3, growth_interval=4)


def test_static_scale_keyword_is_value_with_a_warning():
    with warns_here(r"StaticLossScale\(scale=...\)` is .*\(value=...\)"):
        old = lossscale.StaticLossScale(scale=512)
    assert old == lossscale.StaticLossScale(512)


def test_a_static_config_written_by_0_2_is_read_with_a_warning():
    saved = json.loads('{"kind": "static", "scale": 256.0}')  # 0.2's get_config
    with warns_here("config key 'scale' is 'value'"):
        state = lossscale.LossScale.from_config(saved)
    assert state == lossscale.StaticLossScale(256.0)
    assert saved == {"kind": "static", "scale": 256.0}  # not modified


def test_check_config_of_a_0_2_static_config_names_the_renamed_key():
    saved = {"kind": "static", "scale": 256.0}
    with warns_here("config key 'scale' is 'value'"):
        lossscale.checkpoints.check_config(saved, lossscale.StaticLossScale(256.0))
    # Another value is still refused, under the new key.
    with (
        warns_here("'scale' is 'value'"),
        pytest.raises(ValueError, match=r"value: checkpoint 256.0, code 512.0"),
    ):
        lossscale.checkpoints.check_config(saved, lossscale.StaticLossScale(512.0))


def test_select_tree_is_optax_tree_where_with_a_warning():
    new, old = {"w": jnp.array([1.0, 2.0])}, {"w": jnp.array([0.0, 0.0])}
    for pred in (False, True):
        with warns_here(r"optax.tree_utils.tree_where\(pred, a, b\)"):
            got = lossscale.select_tree(jnp.asarray(pred), new, old)
        assert tree_equal(got, optax.tree_utils.tree_where(pred, new, old))
    with warns_here("tree_where"), pytest.raises(ValueError, match="`pred`.*scalar"):
        lossscale.select_tree(jnp.array([True, False]), new, old)


def test_loss_scale_like_is_the_union_with_a_warning():
    with warns_here("LossScaleLike"):
        alias = lossscale.LossScaleLike
    assert set(alias.__args__) == {lossscale.LossScale, float, int, str, type(None)}


def test_lowest_and_highest_scale_read_min_and_max_scale_with_a_warning():
    state = lossscale.DynamicLossScale(min_scale=2.0, max_scale=64.0, scale=8.0)
    with warns_here(r"state.lowest_scale` is `state.min_scale"):
        assert state.lowest_scale == 2.0
    with warns_here(r"state.highest_scale` is `state.max_scale"):
        assert state.highest_scale == 64.0
    with warns_here("lowest_scale"):
        assert lossscale.StaticLossScale(4.0).lowest_scale == 4.0
    with pytest.raises(AttributeError, match="no attribute 'lowest_scal'"):
        state.lowest_scal  # noqa: B018


def test_a_kinds_adjust_method_is_its_rule_with_a_warning():
    with warns_here(r"Halving.adjust\(self, grads_finite\)` is .*rule"):

        class Halving(lossscale.LossScale, kind="tests.migration.halving"):
            scale: jax.Array = lossscale.field(dtype=jnp.float32, default=8.0)

            def adjust(self, grads_finite):
                return self.replace(scale=jnp.where(grads_finite, self.scale, 1.0))

    state = lossscale.update(Halving(), jnp.asarray(False))
    assert float(state.scale) == 1.0 and int(state.skipped_steps) == 1


def test_an_adjust_method_on_a_built_in_kinds_subclass_replaces_its_rule():
    # Without the alias, the built-in rule would run and `adjust` be ignored.
    with warns_here("adjust"):

        class Frozen(lossscale.DynamicLossScale):
            def adjust(self, grads_finite):
                return self

    state = lossscale.update(Frozen(scale=8.0), jnp.asarray(False))
    reference = lossscale.update(lossscale.DynamicLossScale(scale=8.0), False)
    assert float(state.scale) == 8.0 != float(reference.scale)


# -- errors that name the new spelling --------------------------------------------


def test_setting_is_an_error_naming_a_static_field():
    with pytest.raises(AttributeError, match=r"field\(static=True, default=...\)"):
        lossscale.setting()  # noqa: B018
    assert not hasattr(lossscale, "setting")
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        lossscale.no_such_name  # noqa: B018


def test_a_positional_field_dtype_is_an_error_naming_the_keyword():
    with pytest.raises(TypeError, match=r"field\(dtype=jnp.float32\)`, annotated"):
        lossscale.field(jnp.float32)
    with pytest.raises(TypeError, match="keywords only"):
        lossscale.field(jnp.float32, shape=(2,))


@pytest.mark.parametrize(
    "old, new", [("lowest_scale", "min_scale"), ("highest_scale", "max_scale")]
)
def test_a_kind_defining_a_0_2_bound_is_refused_naming_the_new_one(old, new):
    body = {
        "__annotations__": {"scale": jax.Array},
        "scale": lossscale.field(dtype=jnp.float32, default=8.0),
        "rule": lambda self, grads_finite: self,
        old: property(lambda self: 2.0),
    }
    with pytest.raises(TypeError, match=f"defines `{old}`.*reads `{new}`"):
        type("Bounded", (lossscale.LossScale,), body, kind=f"tests.migration.{old}")


def test_a_0_2_kinds_init_is_refused_pointing_to_the_migration_page():
    with pytest.raises(TypeError, match=r"super\(\).__init__\(\*\*values\)` is gone"):

        class Old(lossscale.LossScale, kind="tests.migration.old"):
            scale: jax.Array = lossscale.field(dtype=jnp.float32, default=8.0)

            def __init__(self, initial_scale=8.0):
                super().__init__(scale=initial_scale)

            def rule(self, grads_finite):
                return self


def test_0_3_spellings_do_not_warn():
    # `filterwarnings = error`: any warning here fails the test.
    lossscale.DynamicLossScale(8.0, growth_interval=3)
    lossscale.StaticLossScale(value=2.0)
    lossscale.LossScale.from_config({"kind": "static", "value": 2.0})
    state = lossscale.DynamicLossScale(min_scale=2.0)
    assert state.min_scale == 2.0 and np.isfinite(state.max_scale)
