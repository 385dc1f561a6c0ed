"""`lossscale.diagnostics.locate_overflow`: the leaves, op and line of an overflow."""

import equinox as eqx
import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lossscale

F16 = jnp.float16
SCALE = 1024.0


def line_of(marker):
    """`"this file:line"` of the line ending with `# marker`."""
    return helpers.line_of(__file__, marker)


def two_leaf_loss(params, x, y):
    h = jnp.exp(x.astype(F16) * params["a"].astype(F16))  # exp-line
    z = y.astype(F16) * params["b"].astype(F16)  # mul-line
    return jnp.sum(h.astype(jnp.float32)) + jnp.sum(z.astype(jnp.float32))


PARAMS = {"a": jnp.ones(3), "b": jnp.ones(3)}
X_FINE, Y_FINE = jnp.full(3, 0.5), jnp.full(3, 2.0)


def reference_bad_leaves(loss_fn, params, *args):
    """Which unscaled gradients of the scaled loss are not finite: jax.grad."""
    grads = jax.grad(lambda p: loss_fn(p, *args) * SCALE)(params)
    return tuple(
        jax.tree_util.keystr(path)
        for path, g in jax.tree_util.tree_leaves_with_path(grads)
        if not np.isfinite(np.asarray(g, np.float32) / SCALE).all()
    )


def test_a_forward_overflow_in_exp_is_named_with_its_line():
    x = X_FINE.at[1].set(20.0)  # exp(20) overflows float16
    report = lossscale.diagnostics.locate_overflow(
        two_leaf_loss, PARAMS, x, Y_FINE, loss_scale=SCALE
    )
    assert report.kind == "forward"
    assert report.op == "exp" and not report.backward_pass
    assert report.source == line_of("exp-line")
    assert report.function == "two_leaf_loss"
    assert report.loss == np.inf and report.scale == SCALE
    assert report.leaves == reference_bad_leaves(two_leaf_loss, PARAMS, x, Y_FINE)
    text = str(report)
    assert "Forward overflow at loss scale 1024" in text
    assert f"`exp` at {line_of('exp-line')} (in two_leaf_loss)" in text
    assert "No loss scale fixes" in text


def test_a_backward_overflow_in_one_leaf_names_that_leaf_and_the_op():
    # y * b is finite forward; its gradient for b is SCALE * y = 102400 > 65504.
    y = jnp.full(3, 100.0)
    report = lossscale.diagnostics.locate_overflow(
        two_leaf_loss, PARAMS, X_FINE, y, loss_scale=SCALE
    )
    assert report.kind == "backward"
    assert report.leaves == ("['b']",)
    assert report.leaves == reference_bad_leaves(two_leaf_loss, PARAMS, X_FINE, y)
    assert report.op == "mul" and report.backward_pass
    assert report.source == line_of("mul-line")
    assert "Backward overflow at loss scale 1024" in str(report)
    assert "Non-finite gradients: ['b']" in str(report)
    # At a lower scale it is finite: what the report's advice says.
    lower = lossscale.diagnostics.locate_overflow(
        two_leaf_loss, PARAMS, X_FINE, y, loss_scale=8.0
    )
    assert lower.kind is None


def test_a_finite_step_reports_nothing():
    report = lossscale.diagnostics.locate_overflow(
        two_leaf_loss, PARAMS, X_FINE, Y_FINE, loss_scale=SCALE
    )
    assert (report.kind, report.leaves, report.op, report.source) == (
        None,
        (),
        None,
        None,
    )
    expected = float(two_leaf_loss(PARAMS, X_FINE, Y_FINE))
    assert report.loss == expected
    assert str(report).startswith("No overflow at loss scale 1024")


def test_has_aux_and_a_jitted_loss_are_located_inside_the_jit():
    @jax.jit
    def loss_with_aux(params, x, y):
        loss = two_leaf_loss(params, x, y)
        return loss, {"loss": loss}

    x = X_FINE.at[0].set(30.0)
    report = lossscale.diagnostics.locate_overflow(
        loss_with_aux, PARAMS, x, Y_FINE, loss_scale=SCALE, has_aux=True
    )
    assert (report.kind, report.op) == ("forward", "exp")
    assert report.source == line_of("exp-line")


def test_the_scale_comes_from_a_state_or_an_optimizer_state():
    import optax

    y = jnp.full(3, 100.0)
    state = lossscale.DynamicLossScale(scale=SCALE)
    opt_state = lossscale.wrap(optax.sgd(0.1), state).init(PARAMS)
    for loss_scale in (state, opt_state):
        report = lossscale.diagnostics.locate_overflow(
            two_leaf_loss, PARAMS, X_FINE, y, loss_scale=loss_scale
        )
        assert report.kind == "backward" and report.scale == SCALE


class Attention(nn.Module):
    """A float16 attention whose softmax is written without the max subtraction."""

    @nn.compact
    def __call__(self, x):
        q = nn.Dense(4, dtype=F16)(x)
        k = nn.Dense(4, dtype=F16)(x)
        scores = q @ k.T
        weights = jnp.exp(scores)  # linen-softmax-line
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return nn.LayerNorm(dtype=F16)(weights @ x.astype(F16))


def test_a_flax_linen_attention_softmax_overflow_is_located():
    model = Attention()
    x = jnp.ones((3, 4))
    params = model.init(jax.random.key(0), x)["params"]

    def loss_fn(params, x):
        return jnp.mean(model.apply({"params": params}, x).astype(jnp.float32) ** 2)

    assert (
        lossscale.diagnostics.locate_overflow(loss_fn, params, x, loss_scale=SCALE).kind
        is None
    )
    report = lossscale.diagnostics.locate_overflow(
        loss_fn, params, x * 30.0, loss_scale=SCALE
    )
    assert (report.kind, report.op) == ("forward", "exp")
    assert report.source == line_of("linen-softmax-line")
    # jax 0.6's source information names a function without its class.
    assert report.function in ("Attention.__call__", "__call__"), report.function


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(3, 4, dtype=F16, rngs=rngs)
        self.out = nnx.Linear(4, 1, dtype=F16, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))  # nnx-line


def test_an_nnx_model_backward_overflow_names_its_parameters():
    model = NnxMLP(nnx.Rngs(0))
    x = jnp.full((2, 3), 60.0)

    def loss_fn(model, x):
        return jnp.mean(model(x).astype(jnp.float32))

    report = lossscale.diagnostics.locate_overflow(
        loss_fn, model, x, loss_scale=2.0**14
    )
    assert report.kind == "backward"
    paths = [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(model)
    ]
    assert report.leaves and set(report.leaves) <= set(paths)
    assert any("hidden" in leaf and "kernel" in leaf for leaf in report.leaves)
    assert report.backward_pass and report.source == line_of("nnx-line")


def test_an_equinox_model_keeps_its_functions_fixed_and_names_array_leaves():
    model = eqx.nn.MLP(3, 1, 8, depth=2, activation=jax.nn.relu, key=jax.random.key(0))

    def loss_fn(model, x):
        model = jax.tree.map(
            lambda p: p.astype(F16) if eqx.is_inexact_array(p) else p, model
        )
        return jnp.mean(jax.vmap(model)(x.astype(F16)).astype(jnp.float32))

    x = jnp.full((4, 3), 100.0)
    report = lossscale.diagnostics.locate_overflow(
        loss_fn, model, x, loss_scale=2.0**15
    )
    assert report.kind == "backward"
    arrays = [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_leaves_with_path(model)
        if eqx.is_array(leaf)
    ]
    assert report.leaves and set(report.leaves) <= set(arrays)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(loss_scale=-1.0), ValueError, "value"),
        (dict(loss_scale="dynamic"), TypeError, "loss_scale"),
        (dict(loss_scale=SCALE, has_aux=1), TypeError, "has_aux"),
    ],
)
def test_bad_settings_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        lossscale.diagnostics.locate_overflow(
            two_leaf_loss, PARAMS, X_FINE, Y_FINE, **kwargs
        )


def test_has_aux_that_does_not_match_the_loss_function_says_how_to_set_it():
    with pytest.raises(TypeError, match="pass `has_aux=False`"):
        lossscale.diagnostics.locate_overflow(
            two_leaf_loss, PARAMS, X_FINE, Y_FINE, loss_scale=SCALE, has_aux=True
        )
    with pytest.raises(TypeError, match="pass `has_aux=True`"):
        lossscale.diagnostics.locate_overflow(
            lambda *a: (two_leaf_loss(*a), {}), PARAMS, X_FINE, Y_FINE, loss_scale=SCALE
        )


def test_bad_functions_and_params_are_refused():
    with pytest.raises(TypeError, match="`loss_fn` must be callable"):
        lossscale.diagnostics.locate_overflow("loss", PARAMS, loss_scale=SCALE)
    with pytest.raises(ValueError, match="no floating-point array"):
        lossscale.diagnostics.locate_overflow(lambda p: 0.0, {"n": 3}, loss_scale=SCALE)
    with pytest.raises(ValueError, match=r"`loss_fn\(params, ...\)` must be a scalar"):
        lossscale.diagnostics.locate_overflow(
            lambda p: p["a"], PARAMS, loss_scale=SCALE
        )
    with pytest.raises(TypeError, match=r"`loss_fn\(params, ...\)`"):
        lossscale.diagnostics.locate_overflow(
            lambda p: jnp.int32(1), PARAMS, loss_scale=SCALE
        )


# -- where the blame goes: the pass, the op under a call, what reaches the result ----


def test_a_backward_overflow_inside_a_jitted_loss_is_in_the_backward_pass():
    # The transposed `jit` call's equations have a name stack of their own, with no
    # "transpose" in it: the pass comes from the call around them.
    y = jnp.full(3, 100.0)
    plain = lossscale.diagnostics.locate_overflow(
        two_leaf_loss, PARAMS, X_FINE, y, loss_scale=SCALE
    )
    jitted = lossscale.diagnostics.locate_overflow(
        jax.jit(two_leaf_loss), PARAMS, X_FINE, y, loss_scale=SCALE
    )
    assert (jitted.kind, jitted.op, jitted.backward_pass) == ("backward", "mul", True)
    assert jitted == plain, f"{jitted}\n{plain}"


def checkpointed_loss(params, x, y):
    return jax.checkpoint(two_leaf_loss)(params, x, y)


@pytest.mark.parametrize(
    "x, y, expected",
    [
        (X_FINE.at[1].set(20.0), Y_FINE, ("forward", "exp", False, "exp-line")),
        (X_FINE, jnp.full(3, 100.0), ("backward", "mul", True, "mul-line")),
    ],
    ids=["forward", "backward"],
)
def test_inside_jax_checkpoint_the_op_under_it_is_named(x, y, expected):
    report = lossscale.diagnostics.locate_overflow(
        checkpointed_loss, PARAMS, x, y, loss_scale=SCALE
    )
    kind, op, backward_pass, marker = expected
    assert (report.kind, report.op, report.backward_pass) == (kind, op, backward_pass)
    assert report.source == line_of(marker), str(report)
    assert report.leaves == reference_bad_leaves(two_leaf_loss, PARAMS, x, y)


class Transpose(nn.Module):
    """A linen module whose name, "transpose", is also a name-stack scope."""

    @nn.compact
    def __call__(self, x):
        return jnp.exp(x.astype(F16))  # transpose-module-line


def scoped_loss(params, x, y):
    with jax.named_scope("transpose"):
        return two_leaf_loss(params, x, y)


def module_loss(params, x, y):
    h = Transpose(name="transpose").apply({}, x * params["a"])
    return jnp.sum(h.astype(jnp.float32)) + jnp.sum(y * params["b"])


@pytest.mark.parametrize(
    "loss_fn, marker",
    [(scoped_loss, "exp-line"), (module_loss, "transpose-module-line")],
    ids=["named_scope", "linen_module"],
)
def test_a_forward_op_under_a_scope_named_transpose_is_in_the_forward_pass(
    loss_fn, marker
):
    x = X_FINE.at[1].set(20.0)
    report = lossscale.diagnostics.locate_overflow(
        loss_fn, PARAMS, x, Y_FINE, loss_scale=SCALE
    )
    assert (report.kind, report.op, report.backward_pass) == ("forward", "exp", False)
    assert report.source == line_of(marker), str(report)
    assert "in the forward pass" in str(report)


def test_an_inf_in_an_aux_metric_is_not_blamed_for_a_gradient_overflow():
    def loss_with_aux(params, x, y):
        log_of_zero = jnp.log(jnp.zeros(()))  # -inf: a metric, not the loss
        return two_leaf_loss(params, x, y), {"log_of_zero": log_of_zero}

    y = jnp.full(3, 100.0)
    report = lossscale.diagnostics.locate_overflow(
        loss_with_aux, PARAMS, X_FINE, y, loss_scale=SCALE, has_aux=True
    )
    # The reference: the same step without the metric.
    plain = lossscale.diagnostics.locate_overflow(
        two_leaf_loss, PARAMS, X_FINE, y, loss_scale=SCALE
    )
    assert (report.kind, report.op, report.source) == ("backward", "mul", plain.source)
    assert report == plain, f"{report}\n{plain}"


def test_an_inf_that_is_masked_away_is_not_blamed_for_a_later_overflow():
    def loss_fn(params, x, y):
        # A fully masked row: its -inf never reaches the loss, `where` drops it.
        scores = jnp.where(jnp.arange(3) < 2, x * params["a"], -jnp.inf)
        kept = jnp.where(jnp.isfinite(scores), scores, 0.0)
        return jnp.sum(kept) + two_leaf_loss(params, x, y)

    x = X_FINE.at[1].set(20.0)
    report = lossscale.diagnostics.locate_overflow(
        loss_fn, PARAMS, x, Y_FINE, loss_scale=SCALE
    )
    assert (report.kind, report.op, report.source) == (
        "forward",
        "exp",
        line_of("exp-line"),
    ), str(report)


# -- a non-finite input is named as such ---------------------------------------------


def batch_loss(params, batch, *, weight):
    return two_leaf_loss(params, batch["x"], batch["y"]) * weight


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize(
    "where, expected",
    [
        ("x", "batch['x']"),
        ("y", "batch['y']"),
        ("weight", "weight"),
        ("param", "params['b']"),
    ],
)
def test_a_non_finite_input_is_named_not_blamed_on_an_op(where, expected, bad):
    batch = {"x": X_FINE, "y": Y_FINE}
    params, weight = dict(PARAMS), jnp.float32(1.0)
    if where in batch:
        batch[where] = batch[where].at[2].set(bad)
    elif where == "weight":
        weight = jnp.float32(bad)
    else:
        params["b"] = params["b"].at[0].set(bad)
    report = lossscale.diagnostics.locate_overflow(
        batch_loss, params, batch, weight=weight, loss_scale=SCALE
    )
    assert report.nonfinite_input == expected, str(report)
    assert report.op is None and report.source is None
    # The loss is as numpy computes it from the same inputs: not finite.
    reference = batch_loss(params, batch, weight=weight)
    assert report.kind == "forward" and not np.isfinite(float(reference))
    text = str(report)
    assert f"The input is not finite: `{expected}`" in text
    assert "compute that op in float32" not in text


def test_a_non_finite_positional_input_is_named_by_its_parameter_name():
    x = X_FINE.at[0].set(np.nan)
    report = lossscale.diagnostics.locate_overflow(
        two_leaf_loss, PARAMS, x, Y_FINE, loss_scale=SCALE
    )
    assert report.nonfinite_input == "x", str(report)
    unnamed = lossscale.diagnostics.locate_overflow(
        lambda params, *batch: two_leaf_loss(params, *batch),
        PARAMS,
        X_FINE,
        Y_FINE.at[0].set(np.inf),
        loss_scale=SCALE,
    )
    assert unnamed.nonfinite_input == "args[1]", str(unnamed)


def test_an_overflow_from_finite_inputs_names_no_input():
    report = lossscale.diagnostics.locate_overflow(
        two_leaf_loss, PARAMS, X_FINE.at[1].set(20.0), Y_FINE, loss_scale=SCALE
    )
    assert report.nonfinite_input is None and report.op == "exp"


def test_a_typed_prng_key_among_the_arguments_is_held_fixed():
    def loss_fn(params, x, y, key):  # dropout, with a `jax.random.key`
        keep = jax.random.bernoulli(key, 0.5, x.shape)
        return two_leaf_loss(params, jnp.where(keep, x, 0.0), y)

    key, x = jax.random.key(0), jnp.full(3, 20.0)  # exp(20) overflows float16
    report = lossscale.diagnostics.locate_overflow(
        loss_fn, PARAMS, x, Y_FINE, key, loss_scale=SCALE
    )
    # The reference: the dropout keeps some of x, and jax.grad's gradients.
    assert jax.random.bernoulli(key, 0.5, x.shape).any()
    assert report.leaves == reference_bad_leaves(loss_fn, PARAMS, x, Y_FINE, key)
    assert (report.kind, report.op) == ("forward", "exp"), str(report)
    assert report.source == line_of("exp-line") and report.nonfinite_input is None


def test_inside_jit_it_says_to_call_it_on_the_host():
    def step(x):
        return lossscale.diagnostics.locate_overflow(
            two_leaf_loss, PARAMS, x, Y_FINE, loss_scale=SCALE
        ).loss

    with pytest.raises(TypeError, match="runs on the host, outside the train step"):
        jax.jit(step)(X_FINE)


def test_arguments_that_do_not_fit_loss_fn_are_named():
    with pytest.raises(TypeError, match=r"`loss_fn\(params, x, y\)` cannot take"):
        lossscale.diagnostics.locate_overflow(
            two_leaf_loss, PARAMS, (X_FINE, Y_FINE), loss_scale=SCALE
        )
    with pytest.raises(TypeError, match="keywords \\['z'\\]"):
        lossscale.diagnostics.locate_overflow(
            two_leaf_loss, PARAMS, X_FINE, Y_FINE, z=1, loss_scale=SCALE
        )


@pytest.mark.parametrize("loss_scale", ["dynamic", None])
def test_a_string_or_none_as_the_scale_says_what_it_takes(loss_scale):
    with pytest.raises(TypeError, match="the scale to evaluate at"):
        lossscale.diagnostics.locate_overflow(
            two_leaf_loss, PARAMS, X_FINE, Y_FINE, loss_scale=loss_scale
        )


def test_an_overflow_inside_a_library_jit_is_named_at_the_users_line():
    # `jnp.cumsum` is jitted: the traceback of the op inside it starts at the jit's
    # boundary, so the line is the enclosing call's, the user's.
    def loss_fn(params, x):
        total = jnp.cumsum(x.astype(F16) * params["a"].astype(F16))  # cumsum-line
        return jnp.sum(total.astype(jnp.float32))

    x = jnp.full(8, 10000.0)  # the running sum passes 65504 at the 7th element
    report = lossscale.diagnostics.locate_overflow(
        loss_fn, {"a": jnp.ones(8)}, x, loss_scale=1.0
    )
    assert report.kind == "forward" and report.op == "cumsum"
    assert report.source == line_of("cumsum-line")


def test_frames_anywhere_in_lossscale_are_skipped_when_naming_the_line():
    # Since `_src` has folders, an op in `api/functional.py` (the multiply of
    # `scale_loss`) must still be attributed to the user's line, not lossscale's.
    from lossscale._src.api import functional
    from lossscale._src.diagnostics.engine import interpret
    from lossscale._src.state import kinds
    from lossscale._src.step import finite

    skipped = interpret._library_dirs(())
    for module in (functional, finite, kinds, interpret):
        assert module.__file__.startswith(skipped), (module.__file__, skipped)


# -- after a skip: the scale the skipped step ran at (issue 50) -------------------

# `y * b` in float16: at 2**15 the gradient for `b`, 3 * 2**15, overflows; at the
# 2**14 a dynamic scale backs off to, it is finite.
Y_OVERFLOWS_AT_2_15 = jnp.full(3, 3.0)


class Thirds(lossscale.LossScale, kind="test_locate.thirds"):
    """A kind of one's own: the scale divides by 3 on an overflow."""

    scale: jax.Array = lossscale.field(dtype=jnp.float32, default=2.0**15)

    def rule(self, grads_finite):
        return self.replace(scale=jnp.where(grads_finite, self.scale, self.scale / 3))


def skipped_with_wrap(loss_scale):
    """The optimizer state of `wrap` after a jitted step that skipped."""
    import optax

    tx = lossscale.wrap(optax.sgd(0.1), loss_scale)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = lossscale.value_and_grad(two_leaf_loss)(opt_state, params, x, y)
        _, opt_state = tx.update(grads, opt_state, params, value=loss)
        return opt_state

    return step(PARAMS, tx.init(PARAMS), X_FINE, Y_OVERFLOWS_AT_2_15)


@pytest.mark.parametrize(
    "after_skip, now",
    [
        (lambda: skipped_with_wrap(lossscale.DynamicLossScale()), 2.0**14),
        (lambda: skipped_with_wrap(Thirds()), 2.0**15 / 3),
        (lambda: lossscale.update(lossscale.DynamicLossScale(), False), 2.0**14),
    ],
    ids=["wrap, dynamic", "wrap, a kind of ones own", "update, dynamic"],
)
def test_the_state_after_a_skip_is_checked_at_the_scale_the_skip_ran_at(
    after_skip, now
):
    # Issue 50: the diagnostics recipe passed the state after the skip, which had
    # backed off, and the batch that overflowed at 2**15 read "No overflow at loss
    # scale 16384".
    state = after_skip()
    assert float(lossscale.get_loss_scale(state).scale) == np.float32(now)
    report = lossscale.diagnostics.locate_overflow(
        two_leaf_loss, PARAMS, X_FINE, Y_OVERFLOWS_AT_2_15, loss_scale=state
    )
    assert (report.kind, report.leaves, report.scale) == ("backward", ("['b']",), 2**15)
    assert report.state_scale == np.float32(now)
    text = str(report)
    assert text.startswith("Backward overflow at loss scale 32768, the scale"), text
    assert f"backed off to {np.float32(now):g} since" in text, text


def test_no_overflow_after_a_skip_names_the_scale_checked_and_the_back_off():
    state = skipped_with_wrap(lossscale.DynamicLossScale())
    y = jnp.ones(3)  # the gradient for `b` is 2**15, finite
    report = lossscale.diagnostics.locate_overflow(
        two_leaf_loss, PARAMS, X_FINE, y, loss_scale=state
    )
    assert report.kind is None and report.scale == 2**15
    assert str(report).startswith(
        "No overflow at loss scale 32768, the scale the state's latest step ran at"
        " (it was skipped, and the state has backed off to 16384 since): the loss"
    ), str(report)
    assert "another batch" in str(report)


def test_a_skip_that_did_not_back_off_is_checked_at_the_same_scale():
    # With hysteresis 2 the first overflow keeps the scale.
    state = skipped_with_wrap(lossscale.DynamicLossScale(hysteresis=2))
    assert float(lossscale.get_loss_scale(state).scale) == 2**15
    report = lossscale.diagnostics.locate_overflow(
        two_leaf_loss, PARAMS, X_FINE, Y_OVERFLOWS_AT_2_15, loss_scale=state
    )
    assert (report.kind, report.scale, report.state_scale) == ("backward", 2**15, None)
    assert "backed off" not in str(report)


def test_after_an_applied_step_the_state_is_checked_at_its_own_scale():
    state = lossscale.update(lossscale.DynamicLossScale(), False)
    state = lossscale.update(state, True)  # applied: the skip is history
    assert float(state.overflow_scale) == 2**15 and int(state.consecutive_skips) == 0
    report = lossscale.diagnostics.locate_overflow(
        two_leaf_loss, PARAMS, X_FINE, Y_OVERFLOWS_AT_2_15, loss_scale=state
    )
    assert (report.kind, report.scale, report.state_scale) == (None, 2**14, None)
    assert str(report).startswith("No overflow at loss scale 16384: the loss")


def test_a_bare_array_of_parameters_is_named_as_the_gradient():
    # The parameters are one array (path ""): no empty list of leaf names.
    def loss(w, y):
        return jnp.sum(y * w)

    w = jnp.ones(3, jnp.float16)
    report = lossscale.diagnostics.locate_overflow(
        loss, w, jnp.full(3, 100.0), loss_scale=SCALE
    )
    assert report.kind == "backward" and report.leaves == ("",)
    text = str(report)
    assert "The gradient is not finite." in text, text
    assert "Non-finite gradients" not in text, text
