"""`lossscale.diagnostics.preflight` and `preflight_step`: each code on a model
written to have its hazard, and on no other model; the clean mixed-precision models get
none.

The models are small but real: Flax linen MLPs on scikit-learn's digits (the full
training set as the batch, as the demo trains), the demo's deep sigmoid MLP, and a
byte-level transformer on the Python documentation. Each hazard test asserts that
the report's codes are exactly that one code (so it is nowhere else in that
program), and the clean programs that they get none; `where` is this file's line.
"""

import functools

import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale
import lossscale.flax
from lossscale import demo

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
ERRORS_AND_WARNINGS = ("error", "warning")


def line_of(marker):
    return helpers.line_of(__file__, marker)


@functools.cache
def digits():
    (x, y), _ = demo.load_digits(0)
    return jnp.asarray(x), jnp.asarray(y)


@functools.cache
def text_batch(rows=4, context=320):
    """Windows of the Python documentation's bytes (as benchmarks/ trains on)."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    data = np.frombuffer("".join(topics[k] for k in sorted(topics)).encode(), np.uint8)
    starts = np.random.default_rng(0).integers(0, len(data) - context - 1, rows)
    windows = np.stack([data[s : s + context + 1] for s in starts]).astype(np.int32)
    return jnp.asarray(windows[:, :-1]), jnp.asarray(windows[:, 1:])


class DigitsMLP(nn.Module):
    """Two hidden layers; `dtype` computes, `param_dtype` stores."""

    dtype: jnp.dtype = F16
    param_dtype: jnp.dtype = F32

    @nn.compact
    def __call__(self, x):
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        x = nn.relu(nn.Dense(64, **dense)(x))  # hidden-line
        x = nn.relu(nn.Dense(64, **dense)(x))
        return nn.Dense(10, **dense)(x)  # logits-line


@functools.cache
def digits_params():
    """`DigitsMLP`'s parameters, initialised once (in float32)."""
    return DigitsMLP().init(jax.random.key(0), digits()[0][:1])["params"]


def digits_problem(model=None, loss="mean"):
    """`(loss_fn, params, x, y)`: cross-entropy in float32, averaged or summed.

    The parameters are `digits_params()` in the model's `param_dtype`.
    """
    model = model or DigitsMLP()
    x, y = digits()
    params = jax.tree.map(lambda p: p.astype(model.param_dtype), digits_params())

    def loss_fn(params, x, y):
        logits = model.apply({"params": params}, x).astype(F32)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return losses.sum() if loss == "sum" else losses.mean()

    return loss_fn, params, x, y


class Mixer(nn.Module):
    """A one-block byte model (embedding, token mixer, head), float16 compute.

    `mix` picks the mixer: causal attention (softmax in float32), or a causal
    running mean (a cumulative sum), or attention with the softmax written out.
    """

    mix: str = "attention"
    width: int = 32

    @nn.compact
    def __call__(self, tokens):
        dense = dict(dtype=F16, param_dtype=F32)
        x = nn.Embed(256, self.width, param_dtype=F32)(tokens).astype(F16)
        h = nn.LayerNorm(dtype=F32, param_dtype=F32)(x).astype(F16)
        if self.mix == "running-mean":
            total = jnp.cumsum(h, axis=1)  # cumsum-line
            h = total / jnp.arange(1, h.shape[1] + 1, dtype=F16)[:, None]
        else:
            q, k, v = jnp.split(nn.Dense(3 * self.width, **dense)(h), 3, axis=-1)
            scores = q @ k.swapaxes(-1, -2)
            causal = jnp.tril(jnp.ones((h.shape[1], h.shape[1]), bool))
            if self.mix == "attention":
                scores = scores.astype(F32) / np.sqrt(self.width)
                weights = jax.nn.softmax(jnp.where(causal, scores, -1e9)).astype(F16)
            else:  # no max subtracted, no 1/sqrt(d)
                weights = jnp.where(causal, jnp.exp(scores), 0)  # exp-line
                weights = weights / weights.sum(-1, keepdims=True)
            h = weights @ v
        x = x + nn.Dense(self.width, **dense)(h)
        return nn.Dense(256, **dense)(x)


@functools.cache
def text_params(mix):
    model = Mixer(mix="running-mean" if mix == "running-mean" else "attention")
    return model.init(jax.random.key(0), text_batch()[0])["params"]


def text_problem(**settings):
    model = Mixer(**settings)
    tokens, targets = text_batch()
    params = text_params(model.mix)

    def loss_fn(params, tokens, targets):
        logits = model.apply({"params": params}, tokens).astype(F32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return loss_fn, params, tokens, targets


def finite_at(loss_fn, params, *args):
    """Whether the scaled gradients are finite at a scale, by plain `jax.grad`."""
    grad = jax.jit(jax.grad(lambda p, s: loss_fn(p, *args) * s))

    def finite(scale):
        grads = grad(params, jnp.float32(scale))
        return all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))

    return finite


def check_scale(report, finite):
    """`report.scale` is the largest power of two <= 2**24 finite at twice it."""
    scale = report.scale
    assert scale == 2.0 ** round(np.log2(scale)) and scale <= 2.0**24, scale
    assert finite(2 * scale), scale
    if scale < 2.0**24:
        assert not finite(4 * scale), scale


def serious(report):
    return [f for f in report.findings if f.severity in ERRORS_AND_WARNINGS]


# -- clean programs --------------------------------------------------------------


def test_a_clean_mixed_precision_mlp_gets_no_error_or_warning():
    loss_fn, params, x, y = digits_problem()
    tx = lossscale.wrap(optax.adam(1e-3), "dynamic")
    report = lossscale.diagnostics.preflight(loss_fn, params, x, y, optimizer=tx)
    assert serious(report) == [], str(report)
    check_scale(report, finite_at(loss_fn, params, x, y))


@pytest.mark.slow
def test_a_clean_float16_transformer_gets_no_error_or_warning():
    loss_fn, params, tokens, targets = text_problem()
    tx = lossscale.wrap(optax.adam(1e-3), "dynamic")
    report = lossscale.diagnostics.preflight(
        loss_fn, params, tokens, targets, optimizer=tx
    )
    assert serious(report) == [], str(report)
    assert report.scale is not None


# -- one program per code --------------------------------------------------------


@pytest.mark.slow
def test_half_accumulation_is_a_float16_cumulative_sum_with_its_line():
    loss_fn, params, tokens, targets = text_problem(mix="running-mean")
    report = lossscale.diagnostics.preflight(loss_fn, params, tokens, targets)
    assert report.codes == {"half-accumulation"}, str(report)
    (finding,) = report.findings
    assert finding.where == line_of("cumsum-line")
    assert "`cumsum` of 320 values" in finding.message


@pytest.mark.slow
def test_forward_overflow_is_an_exp_that_overflows_float16_with_its_line():
    loss_fn, params, tokens, targets = text_problem(mix="exp")
    report = lossscale.diagnostics.preflight(loss_fn, params, tokens, targets)
    assert report.codes == {"forward-overflow"}, str(report)
    # Only the exp: not the float16 ops after it, whose inputs come (through
    # float32 values, whose NaN XLA:CPU's float32 `max` may miss) from the inf.
    assert [f.where for f in report.findings] == [line_of("exp-line")], str(report)
    assert report.scale is None, str(report)  # the loss is not finite
    # The reference: the loss, computed as the program says, is not finite.
    assert not np.isfinite(float(jax.jit(loss_fn)(params, tokens, targets)))


def masked_attention_loss(params, x, y):
    """Causal float16 attention, its mask `-inf`, as many models write it."""
    h = x.astype(F16)
    q, k, v = (h @ params[name].astype(F16) for name in "qkv")
    scores = q @ k.swapaxes(-1, -2) / F16(4.0)  # sqrt(head dim)
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    return jnp.mean(((weights @ v).astype(F32) - y) ** 2)


def test_an_inf_causal_mask_that_the_softmax_makes_zero_is_not_blamed():
    *keys, x_key, y_key = jax.random.split(jax.random.key(0), 5)
    params = {
        n: jax.random.normal(k, (16, 16)) / 4 for n, k in zip("qkv", keys, strict=True)
    }
    x = jax.random.normal(x_key, (4, 32, 16))
    y = jax.random.normal(y_key, (4, 32, 16))
    report = lossscale.diagnostics.preflight(masked_attention_loss, params, x, y)
    assert serious(report) == [], str(report)
    # The reference: the loss and the gradients at the starting scale are finite.
    assert np.isfinite(float(masked_attention_loss(params, x, y)))
    assert finite_at(masked_attention_loss, params, x, y)(2.0**15)


def padded_attention_loss(mask_value):
    """Causal float16 attention over left-padded rows, masked with `mask_value`.

    A padding position's query row has no key left: with a mask float16 holds
    (-65504) its softmax is uniform; with tunix's -2.3819763e38, -inf in float16,
    it is NaN, which the loss drops and its gradient does not.
    """

    def loss_fn(params, x, valid):
        h = x.astype(F16)
        q, k, v = (h @ params[name].astype(F16) for name in "qkv")
        scores = q @ k.swapaxes(-1, -2) / F16(4.0)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        keep = causal & valid[:, None, :]
        scores = jnp.where(keep, scores, mask_value)  # padded-mask-line
        weights = jax.nn.softmax(scores.astype(F32), axis=-1).astype(F16)
        out = (weights @ v).astype(F32)
        return jnp.sum(jnp.where(valid[..., None], out**2, 0.0)) / jnp.sum(valid)

    return loss_fn


def padded_attention_problem():
    *keys, x_key = jax.random.split(jax.random.key(0), 4)
    params = {
        n: jax.random.normal(k, (16, 16)) / 4 for n, k in zip("qkv", keys, strict=True)
    }
    x = jax.random.normal(x_key, (2, 8, 16))
    valid = jnp.ones((2, 8), bool).at[:, :3].set(False)  # left padding
    return params, x, valid


def test_a_mask_constant_float16_makes_inf_is_an_error_no_scale_fixes():
    # Issue 57: tunix's K_MASK in float16. `preflight` gave a warning at a later
    # op and `locate_overflow` advised a lower scale; no scale gives finite
    # gradients, and the line to change is the mask's.
    params, x, valid = padded_attention_problem()
    loss_fn = padded_attention_loss(-2.3819763e38)
    report = lossscale.diagnostics.preflight(loss_fn, params, x, valid)
    (finding,) = serious(report)
    assert (finding.code, finding.severity) == ("gradient-overflow", "error"), report
    assert finding.where == helpers.line_of(__file__, "padded-mask-line"), report
    assert "the constant -2.3819763e+38, -inf in float16" in finding.message
    assert "jnp.finfo(jnp.float16).min" in finding.fix
    assert report.scale is None
    located = str(
        lossscale.diagnostics.locate_overflow(loss_fn, params, x, valid, loss_scale=1.0)
    )
    assert "No loss scale avoids it" in located and "lower scale" not in located
    assert helpers.line_of(__file__, "padded-mask-line") in located
    # The reference: not finite at any scale from 2**15 down to 2**-24 ...
    finite = finite_at(loss_fn, params, x, valid)
    assert not any(finite(2.0**e) for e in (15, 0, -24))
    # ... and the fix it gives: with float16's lowest value, no error, nothing
    # at the mask (a constant near float16's largest is no headroom hazard), a
    # scale to start at, and finite gradients there.
    fixed = padded_attention_loss(float(jnp.finfo(F16).min))
    report = lossscale.diagnostics.preflight(fixed, params, x, valid)
    assert [f.severity for f in serious(report)] in ([], ["warning"]), str(report)
    assert helpers.line_of(__file__, "padded-mask-line") not in str(report)
    assert report.scale is not None and finite_at(fixed, params, x, valid)(report.scale)


def test_a_backward_overflow_at_every_scale_is_an_error_at_its_op():
    def loss_fn(w, x):
        return jnp.sum(jnp.sqrt(x.astype(F16) * w.astype(F16)).astype(F32))  # sqrt-line

    w, x = jnp.ones(4), jnp.arange(4.0)  # sqrt(0): an infinite derivative
    report = lossscale.diagnostics.preflight(loss_fn, w, x)
    (finding,) = serious(report)
    assert (finding.code, finding.severity) == ("gradient-overflow", "error"), report
    assert finding.where == helpers.line_of(__file__, "sqrt-line"), report
    assert report.scale is None
    # The reference: the gradient is inf at scale 2**-24 already.
    assert not finite_at(loss_fn, w, x)(2.0**-24)


def test_a_backward_overflow_is_blamed_at_its_op_past_a_harmless_forward_inf():
    def loss_fn(w, x, valid):
        h = x.astype(F16) * w.astype(F16)
        pooled = jnp.max(jnp.where(valid, h, -jnp.inf), axis=-1)  # a row keeps 5
        root = jnp.sqrt(h[:, 0] * F16(0))  # sqrt-of-zero-line
        return (jnp.sum(pooled) + jnp.sum(root)).astype(F32)

    w, x = jnp.ones((4, 8)), jnp.linspace(0.1, 1.0, 32).reshape(4, 8)
    valid = jnp.broadcast_to(jnp.arange(8) < 5, (4, 8))
    report = lossscale.diagnostics.preflight(loss_fn, w, x, valid)
    (finding,) = [f for f in report.findings if f.severity == "error"]
    assert finding.code == "gradient-overflow", report
    assert finding.where == helpers.line_of(__file__, "sqrt-of-zero-line"), report
    assert "backward pass at every scale" in finding.message, finding.message
    # The reference: the -inf padding is finite after the max, and the
    # gradients are not finite at 2**-24 already.
    assert np.isfinite(float(loss_fn(w, x, valid)))
    assert not finite_at(loss_fn, w, x, valid)(2.0**-24)


def test_an_overflow_that_the_loss_masks_and_its_gradient_does_not_see_is_not_blamed():
    def loss_fn(params, x):
        h = x.astype(F16) * params["w"].astype(F16)
        scores = h * F16(1e4)  # inf at x = 20, where the mask drops it
        return jnp.mean(jnp.where(x < 5, scores, 0).astype(F32))

    params, x = {"w": jnp.ones(8)}, jnp.arange(8.0).at[7].set(20.0)
    report = lossscale.diagnostics.preflight(loss_fn, params, x, loss_scale=1.0)
    assert serious(report) == [], str(report)
    # The reference: the float16 product overflows, yet the loss and the
    # gradients at the starting scale are finite.
    assert not np.isfinite(float(jnp.float16(20) * jnp.float16(1e4)))
    assert np.isfinite(float(loss_fn(params, x)))
    assert finite_at(loss_fn, params, x)(1.0)


@pytest.mark.parametrize("where", ["x", "params['Dense_1']['kernel']"])
def test_a_non_finite_input_is_named_not_blamed_on_the_op_reading_it(where):
    loss_fn, params, x, y = digits_problem()
    if where == "x":
        x = x.at[5, 3].set(np.nan)
    else:
        kernel = params["Dense_1"]["kernel"]
        params["Dense_1"]["kernel"] = kernel.at[0, 0].set(np.inf)
    report = lossscale.diagnostics.preflight(loss_fn, params, x, y)
    assert report.codes == {"forward-overflow"}, str(report)
    (finding,) = report.findings
    assert finding.where == where, str(report)
    assert f"The input is not finite: `{where}`" in finding.message
    assert "float32" not in finding.fix and "Clean the data" in finding.fix
    # The reference: the loss, computed as the program says, is not finite.
    assert not np.isfinite(float(jax.jit(loss_fn)(params, x, y)))


class Standardized(nn.Module):
    """Raw digits pixels (0-16), centred with their batch mean, summed in float16."""

    @nn.compact
    def __call__(self, pixels):
        x = pixels.astype(F16)
        mean = x.sum(axis=0) / x.shape[0]  # sum-line
        return DigitsMLP()((x - mean) / 16)


def test_forward_headroom_is_a_float16_sum_near_its_largest_value():
    model = Standardized()
    x, y = digits()
    pixels = x * 16  # sklearn's values, not divided by 16
    params = {"DigitsMLP_0": digits_params()}

    def loss_fn(params, pixels, y):
        logits = model.apply({"params": params}, pixels).astype(F32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    report = lossscale.diagnostics.preflight(loss_fn, params, pixels, y)
    assert report.codes == {"forward-headroom"}, str(report)
    assert report.findings[0].where == line_of("sum-line")
    # The reference: the largest column sum, in float64, is within 8x of 65504.
    largest = np.max(np.asarray(pixels, np.float64).sum(axis=0))
    assert 65504 / 8 <= largest < 65504, largest
    assert f"{largest:.4g}" in report.findings[0].message


def test_loss_in_half_is_a_cross_entropy_on_float16_logits_with_its_line():
    model = DigitsMLP()
    x, y = digits()
    params = digits_params()

    def loss_fn(params, x, y):
        logits = model.apply({"params": params}, x)  # float16
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()  # ce

    report = lossscale.diagnostics.preflight(loss_fn, params, x, y)
    assert report.codes == {"loss-in-half"}, str(report)
    assert report.findings[0].where == line_of("ce")


def test_gradient_overflow_is_a_summed_loss_at_the_default_scale():
    loss_fn, params, x, y = digits_problem(loss="sum")
    report = lossscale.diagnostics.preflight(loss_fn, params, x, y)
    assert report.codes == {"gradient-overflow"}, str(report)
    # The reference: plain gradients at the default start, 2**15, overflow.
    finite = finite_at(loss_fn, params, x, y)
    assert not finite(2.0**15)
    check_scale(report, finite)
    assert report.findings[0].where in {line_of("hidden-line"), line_of("logits-line")}
    assert f"scale=2.0**{round(np.log2(report.scale))}" in report.findings[0].fix


def demo_problem():
    """The demo's deep sigmoid MLP computing in float16 (float32 parameters)."""
    (x, y), _ = demo.load_digits(0)
    params = demo.init_mlp(jax.random.key(0), demo.SIZES)
    return demo.loss_fn, params, jnp.asarray(x), jnp.asarray(y), F16


def lost_to_zero(loss_fn, params, *args, low, high):
    """Per leaf, gradient values nonzero at scale `high` and zero at `low`."""
    grad = jax.jit(jax.grad(lambda p, s: loss_fn(p, *args) * s))
    at_low, at_high = grad(params, jnp.float32(low)), grad(params, jnp.float32(high))
    lost = jax.tree.map(lambda a, b: int(jnp.sum((b != 0) & (a == 0))), at_low, at_high)
    nonzero = sum(int(jnp.sum(g != 0)) for g in jax.tree.leaves(at_high))
    paths = {
        jax.tree_util.keystr(p): n for p, n in jax.tree_util.tree_leaves_with_path(lost)
    }
    return paths, nonzero


@pytest.mark.slow
def test_gradient_underflow_is_a_deep_sigmoid_mlp_at_a_low_static_scale():
    loss_fn, params, *args = demo_problem()
    report = lossscale.diagnostics.preflight(loss_fn, params, *args, loss_scale=2.0**4)
    assert report.codes == {"gradient-underflow"}, str(report)
    (finding,) = report.findings
    # The reference: plain gradients at 2**4 against those at report.scale.
    lost, nonzero = lost_to_zero(loss_fn, params, *args, low=2.0**4, high=report.scale)
    assert sum(lost.values()) > 0.01 * nonzero, (lost, nonzero)
    assert finding.where == max(lost, key=lost.get), (finding.where, lost)
    assert f"scale=2.0**{round(np.log2(report.scale))}" in finding.fix


def test_gradient_underflow_says_how_many_values_its_scale_still_loses():
    def loss_fn(params, x, y):  # an auxiliary loss, weighted 1e-10
        pred = x.astype(F16) * params["w"].astype(F16)
        return 1e-10 * jnp.mean((pred.astype(F32) - y) ** 2)

    keys = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.random.normal(keys[0], (256, 16)) / 4}
    x, y = (jax.random.normal(k, (256, 16)) for k in keys[1:])
    report = lossscale.diagnostics.preflight(loss_fn, params, x, y, loss_scale=4.0)
    assert report.codes == {"gradient-underflow"}, str(report)
    (finding,) = report.findings

    # The reference: the gradients, each float16 value rounded as the program
    # says (as the probe compiles it), at `report.scale` and at twice it, the
    # largest scale probed.
    def grads(scale):
        grad = jax.jit(jax.grad(lambda p, s: loss_fn(p, x, y) * s))
        compiled = grad.lower(params, F32(scale)).compile(
            compiler_options={"xla_allow_excess_precision": False}
        )
        return np.asarray(compiled(params, F32(scale))["w"])

    at_scale, kept = grads(report.scale), grads(2 * report.scale) != 0
    still = np.sum(kept & (at_scale == 0)) / np.sum(kept)
    assert still > 0.01, still  # 2**24, the largest scale, does not keep them all
    assert f"There {still:.1%} of the nonzero values are still zero" in finding.fix, (
        still,
        finding.fix,
    )
    assert "which keeps them" not in finding.fix


@pytest.mark.slow
def test_unscaled_half_gradients_is_the_deep_mlp_without_loss_scaling():
    loss_fn, params, *args = demo_problem()
    report = lossscale.diagnostics.preflight(
        loss_fn, params, *args, loss_scale=lossscale.NoOpLossScale()
    )
    assert report.codes == {"unscaled-half-gradients"}, str(report)
    lost, nonzero = lost_to_zero(loss_fn, params, *args, low=1.0, high=report.scale)
    assert sum(lost.values()) > 0.01 * nonzero, (lost, nonzero)
    assert report.findings[0].where == max(lost, key=lost.get), lost


def test_optimizer_underflow_is_adams_eps_with_float16_parameters():
    model = DigitsMLP(dtype=F16, param_dtype=F16)
    loss_fn, params, x, y = digits_problem(model)
    tx = lossscale.wrap(optax.adam(1e-3), "dynamic")
    report = lossscale.diagnostics.preflight(loss_fn, params, x, y, optimizer=tx)
    assert report.codes == {"optimizer-underflow"}, str(report)
    (finding,) = report.findings
    assert finding.severity == "error"
    leaf = params
    for key in finding.where.strip("[]'").split("']['"):
        leaf = leaf[key]
    # The reference: optax's Adam on a zero float16 gradient gives NaN (eps = 0).
    adam = optax.adam(1e-3)
    update, _ = jax.jit(adam.update)(jnp.zeros_like(leaf), adam.init(leaf), leaf)
    assert np.isnan(np.asarray(update, np.float32)).all(), update
    assert np.float16(1e-8) == 0


def half_params_problem():
    """The guide's program: float16 parameters, float16 compute."""

    def loss_fn(params, x, y):
        pred = x.astype(F16) @ params["w"] + params["b"]
        return jnp.mean((pred.astype(F32) - y) ** 2)

    params = {"w": jnp.full((16, 1), 0.25, F16), "b": jnp.zeros(1, F16)}
    x = jax.random.normal(jax.random.key(1), (1024, 16))
    y = jax.random.normal(jax.random.key(2), (1024, 1))
    return loss_fn, params, x, y


def broken_in_float16_only(tx, params, grads):
    """Whether optax's update is not finite from a float16 state, and is from float32.

    Each state from `tx.init` of the parameters in that dtype, as `preflight`'s.
    """
    broken = []
    for dtype in (F16, F32):
        wide = jax.tree.map(lambda p, d=dtype: p.astype(d), params)
        g = jax.tree.map(lambda g, d=dtype: g.astype(d), grads)
        update = jax.jit(tx.update)(g, tx.init(wide), wide)[0]
        leaves = [np.asarray(u, np.float32) for u in jax.tree.leaves(update)]
        broken.append(not all(np.isfinite(u).all() for u in leaves))
    return broken == [True, False]


def test_optimizer_underflow_is_an_eps_held_in_a_float16_optimizer_state():
    loss_fn, params, x, y = half_params_problem()
    # `inject_hyperparams` keeps `eps` in the state, in the parameters' dtype.
    adam = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    tx = lossscale.wrap(adam, "dynamic")
    report = lossscale.diagnostics.preflight(loss_fn, params, x, y, optimizer=tx)
    assert report.codes == {"optimizer-underflow"}, str(report)
    assert "gradients of zero" in report.findings[0].message
    # The reference: the state holds eps as float16 0, so optax's update of a
    # zero gradient is NaN; from a float32 state, it is zero.
    assert adam.init(params).hyperparams["eps"] == 0
    assert broken_in_float16_only(adam, params, jax.tree.map(jnp.zeros_like, params))


def test_a_typed_prng_key_in_the_optimizer_state_is_held_fixed():
    loss_fn, params, x, y = half_params_problem()
    # Gradient noise, its key a `jax.random.key`, so small that Adam's float16
    # second moment of it is 0.
    noisy = optax.chain(
        optax.add_noise(1e-8, 0.55, jax.random.key(0)), optax.adam(1e-3)
    )
    report = lossscale.diagnostics.preflight(
        loss_fn, params, x, y, optimizer=lossscale.wrap(noisy, "dynamic")
    )
    assert report.codes == {"optimizer-underflow"}, str(report)
    # jax 0.6 names the lambda inside `scale_by_adam` where later jax names it.
    message = report.findings[0].message
    assert "comes from `div` in `scale_by_adam" in message or (
        "comes from `div` in `<lambda>` (optax/_src/transform.py" in message
    ), message
    assert broken_in_float16_only(noisy, params, jax.tree.map(jnp.zeros_like, params))


def test_update_underflow_is_adam_on_bfloat16_parameters():
    model = DigitsMLP(dtype=BF16, param_dtype=BF16)
    loss_fn, params, x, y = digits_problem(model)
    tx = optax.adam(1e-4)  # below half a bfloat16 ulp of most weights (|w| > 2**-5)
    report = lossscale.diagnostics.preflight(
        loss_fn, params, x, y, optimizer=tx, loss_scale=lossscale.NoOpLossScale()
    )
    assert report.codes == {"update-underflow"}, str(report)

    # The reference: the same update, applied by optax, leaves > 10% unchanged.
    @jax.jit
    def step(params):
        updates, _ = tx.update(jax.grad(loss_fn)(params, x, y), tx.init(params))
        return optax.apply_updates(params, updates), updates

    new, updates = step(params)
    shares = {
        jax.tree_util.keystr(path): float(jnp.mean((n == p)[u != 0]))
        for (path, p), n, u in zip(
            jax.tree_util.tree_leaves_with_path(params),
            jax.tree.leaves(new),
            jax.tree.leaves(updates),
            strict=True,
        )
    }
    assert report.findings[0].where == max(shares, key=shares.get), shares
    assert shares[report.findings[0].where] > 0.1


def test_bfloat16_dynamic_scale_is_information_only():
    model = DigitsMLP(dtype=BF16, param_dtype=F32)
    loss_fn, params, x, y = digits_problem(model)
    tx = lossscale.wrap(optax.adam(1e-3), "dynamic")
    report = lossscale.diagnostics.preflight(loss_fn, params, x, y, optimizer=tx)
    assert report.codes == {"bfloat16-dynamic-scale"}, str(report)
    assert report.findings[0].severity == "info"
    # Without the dynamic scale, nothing is said.
    none = lossscale.diagnostics.preflight(
        loss_fn, params, x, y, loss_scale=lossscale.NoOpLossScale()
    )
    assert none.codes == set(), str(none)


# -- preflight_step --------------------------------------------------------------


def sgd_steps():
    """Three train steps with `wrap(sgd)`: right, loss not scaled, clip outside."""
    model = DigitsMLP()
    x, y = digits()
    params = digits_params()

    def loss_fn(params):
        logits = model.apply({"params": params}, x).astype(F32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def right(state):
        params, opt_state = state
        grads = jax.grad(lambda p: lossscale.scale_loss(loss_fn(p), opt_state))(params)
        updates, opt_state = wrapped.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def unscaled_loss(state):
        params, opt_state = state
        grads = jax.grad(loss_fn)(params)  # the loss is not scaled
        updates, opt_state = wrapped.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def clipped_outside(state):
        params, opt_state = state
        grads = jax.grad(lambda p: lossscale.scale_loss(loss_fn(p), opt_state))(params)
        updates, opt_state = clip_outside.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    wrapped = lossscale.wrap(optax.sgd(0.5), "dynamic")
    clip_outside = optax.chain(optax.clip_by_global_norm(1.0), wrapped)
    return {
        "right": (jax.jit(right), (params, wrapped.init(params))),
        "unscaled loss": (jax.jit(unscaled_loss), (params, wrapped.init(params))),
        "clip outside": (jax.jit(clipped_outside), (params, clip_outside.init(params))),
    }


@pytest.mark.slow
def test_preflight_step_finds_the_unscaled_loss_and_the_clip_outside_the_wrap():
    for name, (step, state) in sgd_steps().items():
        report = lossscale.diagnostics.preflight_step(step, state)
        expected = set() if name == "right" else {"scale-dependent-step"}
        assert report.codes == expected, (name, str(report))
        if name != "right":
            # The reference: SGD's updates at 2**15 and 2**14 are a factor 2 apart.
            (finding,) = report.findings
            assert finding.where.startswith("[0]"), finding.where
            assert "2x at the lower scale" in finding.message, finding.message
            which = {
                "unscaled loss": "Its gradients are not those of the scaled loss",
                "clip outside": "a transformation reads them before they are unscaled",
            }
            assert which[name] in finding.message, finding.message


def small_steps():
    """The guide's small program, stepped through each API, right and wrong.

    `(api, mistake) -> (step, state)`: the mistake is None, "unscaled loss" (the
    gradients of the loss, not of the scaled loss) or "clip before" (a clip of
    the scaled gradients, before the unscaling).
    """
    params, sgd = jnp.full((4, 1), 0.5), optax.sgd(0.1)

    def loss_fn(w, x):
        return jnp.mean((x.astype(F16) @ w.astype(F16)) ** 2)

    def gradients(scale_from, params, x, mistake):
        if mistake == "unscaled loss":
            return jax.grad(loss_fn)(params, x)
        grads = lossscale.value_and_grad(loss_fn)(scale_from, params, x)[1]
        if mistake == "clip before":
            return optax.clip_by_global_norm(1e-3).update(grads, None)[0]
        return grads

    def wrap_step(mistake):
        tx = lossscale.wrap(sgd)
        clip_outside = optax.chain(optax.clip_by_global_norm(1e-3), tx)
        chosen = clip_outside if mistake == "clip before" else tx

        def step(state, x):
            params, opt_state = state
            unscaled = mistake == "unscaled loss"  # the clip is `clip_outside`
            grads = gradients(
                opt_state, params, x, "unscaled loss" if unscaled else None
            )
            updates, opt_state = chosen.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        return step, (params, chosen.init(params))

    def functional_step(mistake):
        def step(state, x):
            params, opt_state, loss_scale = state
            grads = gradients(loss_scale, params, x, mistake)
            return lossscale.apply_gradients(
                sgd, grads=grads, params=params, opt_state=opt_state,
                loss_scale=loss_scale,
            )  # fmt: skip

        return step, (params, sgd.init(params), lossscale.StaticLossScale(2.0**10))

    def train_state_step(mistake):
        def step(state, x):
            grads = gradients(state, state.params, x, mistake)
            return state.apply_gradients(grads=grads)

        return step, lossscale.flax.TrainState.create(
            apply_fn=None, params=params, tx=sgd
        )

    return {
        (api, mistake): make(mistake)
        for api, make in (
            ("wrap", wrap_step),
            ("apply_gradients", functional_step),
            ("TrainState", train_state_step),
        )
        for mistake in (None, "unscaled loss", "clip before")
    }


SMALL_STEPS = small_steps()
X = jnp.ones((8, 4))
# What each fix says: the scaled loss's gradients, by the API's own argument; a
# clip after the unscaling, by the API's own setting.
FIXES = {
    ("wrap", "unscaled loss"): "lossscale.value_and_grad(loss_fn)(opt_state, params",
    ("wrap", "clip before"): "`lossscale.wrap(inner, clip_norm=1.0)`",
    ("apply_gradients", "unscaled loss"): "value_and_grad(loss_fn)(loss_scale, params",
    ("apply_gradients", "clip before"): "`lossscale.apply_gradients(..., clip_norm",
    ("TrainState", "unscaled loss"): "value_and_grad(loss_fn)(state, state.params",
    ("TrainState", "clip before"): "`TrainState.create(..., clip_norm=1.0)`",
}


@pytest.mark.parametrize("api, mistake", list(SMALL_STEPS), ids=str)
def test_preflight_step_says_which_mistake_and_the_fix_for_the_api_used(api, mistake):
    step, state = SMALL_STEPS[api, mistake]
    report = lossscale.diagnostics.preflight_step(jax.jit(step), state, X)
    if mistake is None:
        assert report.codes == set(), str(report)
        return
    (finding,) = report.findings
    assert finding.code == "scale-dependent-step", str(report)
    said = {
        "unscaled loss": "Its gradients are not those of the scaled loss",
        "clip before": "a transformation reads them before they are unscaled",
    }
    assert said[mistake] in finding.message, finding.message
    other = said["clip before" if mistake == "unscaled loss" else "unscaled loss"]
    assert other not in finding.message, finding.message
    assert FIXES[api, mistake] in finding.fix, finding.fix
    assert [k for k, text in FIXES.items() if text in finding.fix] == [(api, mistake)]


@pytest.mark.parametrize("api", ["wrap", "apply_gradients", "TrainState"])
def test_preflight_step_runs_a_step_that_donates_its_state_on_copies(api):
    for mistake in (None, "unscaled loss"):
        step, state = SMALL_STEPS[api, mistake]
        before = jax.tree.map(np.array, state)
        donating = lossscale.diagnostics.preflight_step(
            jax.jit(step, donate_argnums=0), state, X
        )
        # The reference: the same step, without donation.
        plain = lossscale.diagnostics.preflight_step(jax.jit(step), state, X)
        assert donating == plain, f"{donating}\n{plain}"
        # The caller's arrays are alive, and as they were.
        leaves = jax.tree.leaves(state)
        assert not any(
            leaf.is_deleted() for leaf in leaves if hasattr(leaf, "is_deleted")
        )
        assert helpers.tree_equal(jax.tree.map(np.array, state), before)


def test_preflight_step_runs_a_step_that_donates_its_batch_on_a_copy():
    tx = lossscale.wrap(optax.sgd(0.1))
    state = {"params": jnp.ones(8), "opt_state": tx.init(jnp.ones(8))}

    def step(state, batch):
        def loss(p):
            return lossscale.scale_loss(jnp.sum((p * batch) ** 2), state["opt_state"])

        grads = jax.grad(loss)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new = optax.apply_updates(state["params"], updates)
        return {"params": new, "opt_state": opt_state}, batch * 2  # reuses its buffer

    batch = jnp.ones(8)
    report = lossscale.diagnostics.preflight_step(
        jax.jit(step, donate_argnums=(0, 1)), state, batch
    )
    assert report.findings == (), report
    assert not batch.is_deleted()


def test_preflight_step_names_donation_by_a_step_bound_to_its_own_objects():
    # As a framework's jitted step (tunix's: `nnx.cached_partial` over the trainer's
    # model and optimizer, donating the optimizer): it ignores the copies it is
    # given and deletes the caller's arrays; the check says so, where it crashed
    # with "Array has been deleted" (issue 57).
    import functools

    from flax import nnx

    def train_step(model, optimizer, x):
        def loss(m):
            return lossscale.scale_loss(jnp.sum(m(x) ** 2), optimizer)

        optimizer.update(model, nnx.grad(loss)(model))

    def fresh():
        model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
        return model, lossscale.flax.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    model, optimizer = fresh()
    jitted = nnx.jit(train_step, donate_argnames=("optimizer",))
    bound = functools.partial(nnx.cached_partial(jitted, model, optimizer))
    with pytest.raises(ValueError, match=r"`step` donated \(deleted\) an array"):
        lossscale.diagnostics.preflight_step(
            lambda state, x: (bound(x), state)[1], (model, optimizer), X
        )
    # The fix it gives: the step over the state it is given, donating or not.
    model, optimizer = fresh()
    for fn in (nnx.jit(train_step), jitted):
        report = lossscale.diagnostics.preflight_step(
            lambda state, x, fn=fn: (fn(*state, x), state)[1], (model, optimizer), X
        )
        assert report.codes == set(), str(report)


def dropping_steps():
    """The guide's small program, stepped through each API, keeping the old loss
    scale: what each returns is the loss-scale state it was given (issue 50)."""
    params, sgd = jnp.full((4, 1), 0.5), optax.sgd(0.1)

    def loss_fn(w, x):
        return jnp.mean((x.astype(F16) @ w.astype(F16)) ** 2)

    tx = lossscale.wrap(sgd)

    def wrap_step(state, x):
        params, opt_state = state
        loss, grads = lossscale.value_and_grad(loss_fn)(opt_state, params, x)
        updates, _ = tx.update(grads, opt_state, params, value=loss)  # dropped
        return optax.apply_updates(params, updates), opt_state

    def functional_step(state, x):
        params, opt_state, loss_scale = state
        loss, grads = lossscale.value_and_grad(loss_fn)(loss_scale, params, x)
        params, opt_state, _ = lossscale.apply_gradients(  # `_`: dropped
            sgd, grads=grads, params=params, opt_state=opt_state,
            loss_scale=loss_scale, value=loss,
        )  # fmt: skip
        return params, opt_state, loss_scale

    def train_state_step(state, x):
        loss, grads = lossscale.value_and_grad(loss_fn)(state, state.params, x)
        new = state.apply_gradients(grads=grads, value=loss)
        return new.replace(loss_scale=state.loss_scale)  # the old one

    return {
        "wrap": (wrap_step, (params, tx.init(params)), "[1].loss_scale"),
        "apply_gradients": (
            functional_step,
            (params, sgd.init(params), lossscale.StaticLossScale(2.0**10)),
            "[2]",
        ),
        "TrainState": (
            train_state_step,
            lossscale.flax.TrainState.create(apply_fn=None, params=params, tx=sgd),
            ".loss_scale",
        ),
    }


DROPPING_FIXES = {
    "wrap": "updates, opt_state = tx.update(grads, opt_state, params)",
    "apply_gradients": "params, opt_state, loss_scale = lossscale.apply_gradients(",
    "TrainState": "Return the state that `state.apply_gradients(grads=grads)`",
}


@pytest.mark.parametrize("api", ["wrap", "apply_gradients", "TrainState"])
def test_preflight_step_finds_a_step_that_drops_the_loss_scale_it_was_returned(api):
    # Issue 50: such a step trains, never counts a skip, never backs off, and
    # `preflight_step` called it clean (its update does not depend on the scale).
    step, state, where = dropping_steps()[api]
    # The reference: one overflow injected, the state it returns has not counted it.
    inf_state = jax.tree.map(
        lambda x: (
            lossscale.DynamicLossScale().replace(scale=float("inf"))
            if isinstance(x, lossscale.LossScale)
            else x
        ),
        state,
        is_leaf=lambda x: isinstance(x, lossscale.LossScale),
    )
    assert int(lossscale.get_loss_scale(step(inf_state, X)).skipped_steps) == 0
    report = lossscale.diagnostics.preflight_step(jax.jit(step), state, X)
    (finding,) = report.findings
    assert (finding.code, finding.severity, finding.where) == (
        "loss-scale-not-returned",
        "error",
        where,
    ), str(report)
    assert "returns the loss-scale state it was given" in finding.message
    assert DROPPING_FIXES[api] in finding.fix, finding.fix
    assert [k for k, text in DROPPING_FIXES.items() if text in finding.fix] == [api]


def test_a_step_that_drops_the_loss_scale_and_depends_on_it_says_both():
    step, state, _ = dropping_steps()["wrap"]
    params, opt_state = state

    def unscaled_and_dropped(state, x):
        params, opt_state = state
        grads = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(params)  # not scaled
        updates, _ = lossscale.wrap(optax.sgd(0.1)).update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    report = lossscale.diagnostics.preflight_step(unscaled_and_dropped, state, X)
    (finding,) = report.findings
    assert finding.code == "loss-scale-not-returned", str(report)
    assert "also changes with the loss scale ([0] (differs by" in finding.message


def nnx_program(scaled=True):
    """The NNX guide's program: a float16 `nnx.Linear`, its optimizer and step."""
    from flax import nnx

    model = nnx.Linear(8, 1, dtype=F16, param_dtype=F32, rngs=nnx.Rngs(0))
    optimizer = lossscale.flax.Optimizer(
        model,
        optax.sgd(0.1),
        wrt=nnx.Param,
        loss_scale=lossscale.DynamicLossScale(scale=2.0**8),
    )

    def loss_fn(model, x, y):
        return jnp.mean((model(x).astype(F32) - y) ** 2)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        def scaled_loss(model):
            loss = loss_fn(model, x, y)
            return (lossscale.scale_loss(loss, optimizer) if scaled else loss), loss

        (_, loss), grads = nnx.value_and_grad(scaled_loss, has_aux=True)(model)
        optimizer.update(model, grads, value=loss)
        return loss

    def step(state, x, y):
        model, optimizer = state
        train_step(model, optimizer, x, y)
        return model, optimizer

    return model, optimizer, loss_fn, step


def test_an_nnx_optimizer_step_is_checked_on_copies_of_the_model_and_optimizer():
    x, y = jnp.ones((16, 8)), jnp.ones((16, 1))
    for scaled in (True, False):
        model, optimizer, _, step = nnx_program(scaled)
        kernel, loss_scale = np.array(model.kernel[...]), optimizer.loss_scale
        report = lossscale.diagnostics.preflight_step(step, (model, optimizer), x, y)
        if scaled:
            assert report.codes == set(), str(report)
        else:
            (finding,) = report.findings
            assert finding.code == "scale-dependent-step", str(report)
            assert "2x at the lower scale" in finding.message, finding.message
            assert "`return lossscale.scale_loss(loss, optimizer), loss`" in finding.fix
        # The caller's model and optimizer are as they were.
        np.testing.assert_array_equal(model.kernel[...], kernel)
        assert optimizer.loss_scale == loss_scale and int(optimizer.step[...]) == 0


def test_an_nnx_optimizer_with_a_static_scale_is_refused_saying_what_to_build():
    from flax import nnx

    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = lossscale.flax.Optimizer(
        model, optax.sgd(0.1), wrt=nnx.Param, loss_scale=1024.0
    )
    with pytest.raises(ValueError, match="needs a `DynamicLossScale`.*'dynamic'"):
        lossscale.diagnostics.preflight_step(
            lambda s, x: s, (model, optimizer), jnp.ones((1, 2))
        )


def test_preflight_takes_an_nnx_optimizer_for_its_tx_and_its_loss_scale():
    # Issue 50: it was refused as "not an optax transformation".
    model, optimizer, loss_fn, _ = nnx_program()
    x, y = jnp.ones((16, 8)), jnp.ones((16, 1))
    report = lossscale.diagnostics.preflight(loss_fn, model, x, y, optimizer=optimizer)
    # The reference: its transformation, at its loss scale.
    expected = lossscale.diagnostics.preflight(
        loss_fn, model, x, y, optimizer=optimizer.tx, loss_scale=optimizer.loss_scale
    )
    assert report == expected, f"{report}\n{expected}"
    assert "2**8" in str(report), str(report)


def test_the_fix_names_the_api_used_when_lossscale_flax_is_not_imported():
    # The fix was NNX's for a `wrap` step when `lossscale.flax` was not imported.
    import os
    import pathlib
    import subprocess
    import sys

    code = """
import sys, jax, jax.numpy as jnp, optax, lossscale
tx = lossscale.wrap(optax.sgd(0.1))
def step(state, x):
    params, opt_state = state
    grads = jax.grad(lambda w: jnp.sum((x @ w) ** 2))(params)  # not scaled
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
params = jnp.ones(4)
report = lossscale.diagnostics.preflight_step(
    step, (params, tx.init(params)), jnp.ones((2, 4))
)
print("lossscale.flax" in sys.modules, report.findings[0].fix)
"""
    root = str(pathlib.Path(__file__).resolve().parents[1])
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": root},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("False "), out.stdout
    assert FIXES["wrap", "unscaled loss"] in " ".join(out.stdout.split()), out.stdout


# -- models, arguments, refusals, the table ---------------------------------------


def test_an_nnx_model_is_checked_through_its_call():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(64, 64, dtype=F16, rngs=rngs)
            self.out = nnx.Linear(64, 10, dtype=F16, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.hidden(x)))

    model = Net(nnx.Rngs(0))
    x, y = digits()

    def loss_fn(model, x, y):
        logits = model(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()  # nnx

    report = lossscale.diagnostics.preflight(loss_fn, model, x, y)
    assert report.codes == {"loss-in-half"}, str(report)
    assert report.findings[0].where == line_of("nnx")


@pytest.mark.slow
def test_an_equinox_model_with_aux_and_a_key_argument_is_clean():
    import equinox as eqx

    model = eqx.nn.MLP(64, 10, 64, depth=2, key=jax.random.key(0))
    dropout = eqx.nn.Dropout(0.1)
    x, y = digits()

    def loss_fn(model, x, y, key):
        half = jax.tree.map(
            lambda p: p.astype(F16) if eqx.is_inexact_array(p) else p, model
        )
        h = dropout(jax.vmap(half)(x.astype(F16)), key=key)
        losses = optax.softmax_cross_entropy_with_integer_labels(h.astype(F32), y)
        return losses.mean(), {"accuracy": jnp.mean(jnp.argmax(h, -1) == y)}

    tx = lossscale.wrap(optax.adam(1e-3))
    report = lossscale.diagnostics.preflight(
        loss_fn, model, x, y, jax.random.key(1), has_aux=True, optimizer=tx
    )
    assert serious(report) == [], str(report)
    assert report.scale is not None


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(loss_fn="loss"), TypeError, "`loss_fn` must be callable"),
        (dict(has_aux=1), TypeError, "`has_aux` must be a bool"),
        (dict(optimizer=optax.adam), TypeError, "`optimizer` must be an optax"),
        (dict(loss_scale=-2.0), ValueError, "`value` must be positive"),
        (dict(loss_scale="static"), ValueError, "the only string allowed"),
        (dict(loss_scale={"no": "state"}), ValueError, "No loss-scale state"),
        (dict(params={"n": 3}), ValueError, "no floating-point array"),
    ],
)
def test_what_cannot_be_checked_is_refused_by_name(kwargs, error, match):
    arguments = dict(
        loss_fn=lambda p, x: jnp.sum(p["w"] * x), params={"w": jnp.ones(2)}
    )
    arguments.update(kwargs)
    loss_fn, params = arguments.pop("loss_fn"), arguments.pop("params")
    with pytest.raises(error, match=match):
        lossscale.diagnostics.preflight(loss_fn, params, jnp.ones(2), **arguments)


def test_arguments_or_has_aux_that_do_not_fit_loss_fn_say_what_to_pass():
    def loss_fn(p, x):
        return jnp.sum(p * x)

    bound = r"`loss_fn\(p, x\)` cannot take .* `preflight\(loss_fn, params, x, y\)`"
    with pytest.raises(TypeError, match=bound):
        lossscale.diagnostics.preflight(loss_fn, jnp.ones(2), jnp.ones(2), jnp.ones(2))
    with pytest.raises(TypeError, match="pass `has_aux=False`"):
        lossscale.diagnostics.preflight(loss_fn, jnp.ones(2), jnp.ones(2), has_aux=True)


def test_a_traced_call_a_non_scalar_loss_and_a_collective_are_refused():
    def traced(w):
        return lossscale.diagnostics.preflight(lambda p: jnp.sum(p), w).scale

    with pytest.raises(TypeError, match="outside `jax.jit`"):
        jax.jit(traced)(jnp.ones(2))
    with pytest.raises(ValueError, match="must be a scalar"):
        lossscale.diagnostics.preflight(lambda p: p * 2, jnp.ones(2))
    with pytest.raises(ValueError, match="reduces over a mapped axis"):
        lossscale.diagnostics.preflight(
            lambda p: jax.lax.pmean(jnp.sum(p), "batch"), jnp.ones(2)
        )
    with pytest.raises(ValueError, match="cannot be set"):
        params = jnp.ones(2)
        tx = lossscale.wrap(optax.sgd(0.1), None)
        lossscale.diagnostics.preflight_step(lambda s: s, (params, tx.init(params)))
    with pytest.raises(TypeError, match="must return the new state"):
        params = jnp.ones(2)
        tx = lossscale.wrap(optax.sgd(0.1))
        lossscale.diagnostics.preflight_step(
            lambda s: {"other": s[0]}, (params, tx.init(params))
        )


def test_the_report_prints_a_table_errors_first():
    finding = functools.partial(lossscale.diagnostics.Finding, message="m.", fix="f.")
    report = lossscale.diagnostics.PreflightReport(
        findings=(
            finding(code="forward-overflow", severity="error", where="a.py:3"),
            finding(code="gradient-underflow", severity="warning", where="['w']"),
        ),
        scale=2.0**10,
        notes=("A note.",),
    )
    lines = str(report).splitlines()
    assert lines[0] == (
        "preflight: 1 error, 1 warning. A dynamic scale can start up to 2**10"
        " (report.scale)."
    )
    assert lines[2].split() == ["severity", "code", "where"]
    assert lines[3].split() == ["error", "forward-overflow", "a.py:3"]
    assert lines[4:6] == ["    m.", "    fix: f."]
    assert lines[6].split() == ["warning", "gradient-underflow", "['w']"]
    assert lines[-1] == "A note."
    assert report.codes == {"forward-overflow", "gradient-underflow"}
    with pytest.raises(ValueError, match="`severity` must be one of"):
        finding(code="x", severity="fatal", where=None)


@pytest.mark.slow
def test_starting_at_report_scale_loses_no_batch_where_the_default_loses_some():
    loss_fn, params, x, y = digits_problem(loss="sum")
    report = lossscale.diagnostics.preflight(loss_fn, params, x, y)
    tx = optax.adam(1e-3)

    @jax.jit
    def step(params, opt_state, loss_scale):
        _, grads = lossscale.value_and_grad(loss_fn)(loss_scale, params, x, y)
        return lossscale.apply_gradients(
            tx, grads=grads, params=params, opt_state=opt_state, loss_scale=loss_scale
        )

    def skipped(start):
        state = (params, tx.init(params), lossscale.DynamicLossScale(scale=start))
        for _ in range(40):
            state = step(*state)
        return int(lossscale.metrics(state[2])["skipped_steps"])

    # The default start backs off once per skipped batch, from 2**15 to a scale
    # at which the summed loss's gradients are finite.
    assert skipped(2.0**15) > 0
    assert skipped(report.scale) == 0


def test_gradient_underflow_of_a_bare_array_names_the_one_array():
    def loss_fn(w, x, y):  # an auxiliary loss, weighted 1e-10
        pred = x.astype(F16) * w.astype(F16)
        return 1e-10 * jnp.mean((pred.astype(F32) - y) ** 2)

    keys = jax.random.split(jax.random.key(0), 3)
    w, x, y = (jax.random.normal(k, (256, 16)) for k in keys)
    report = lossscale.diagnostics.preflight(loss_fn, w / 4, x, y, loss_scale=4.0)
    assert report.codes == {"gradient-underflow"}, str(report)
    (finding,) = report.findings
    assert finding.message.endswith(", in the one parameter array."), finding.message
