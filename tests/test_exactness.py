"""The step's exactness statement, clause by clause, in each backend's form.

The statement (docs/guides/wrap.md, "Exactness") is kept word for word in the README,
the guides and the docstrings; `test_the_statement_is_the_same_everywhere` holds them
together. The catalogue of optax's optimizers runs the bit-for-bit clauses over every
optimizer (tests/test_catalogue.py); this file holds the clauses it does not.
"""

import pathlib
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import bitwise_equal

import lossscale

ROOT = pathlib.Path(__file__).resolve().parent.parent
PARAMS = {"w": jnp.arange(12.0).reshape(3, 4) / 10, "s": jnp.float32(0.5)}


def _grads(bad=False):
    grads = {"w": jnp.full((3, 4), 0.25), "s": jnp.float32(-0.5)}
    return {**grads, "s": jnp.float32(jnp.inf)} if bad else grads


def _calling(calls):
    """An optimizer whose update calls back to the host, with the gradients."""

    def init(params):
        return optax.EmptyState()

    def update(updates, state, params=None):
        jax.debug.callback(lambda s: calls.append(float(s)), updates["s"])
        return jax.tree.map(lambda g: -0.1 * g, updates), state

    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("entry", ["wrap", "apply_gradients"])
def test_a_skipped_step_runs_the_update_only_in_the_select_forms(backend_form, entry):
    # XLA:CPU's cond runs nothing of the update on a skipped step; the select of
    # GPUs and TPUs runs it and throws its result away.
    calls = []
    tx = _calling(calls)
    if entry == "wrap":
        wrapped = lossscale.wrap(tx, lossscale.StaticLossScale(1.0))
        step = jax.jit(lambda g, s, p: wrapped.update(g, s, p))
        state = wrapped.init(PARAMS)
    else:
        step = jax.jit(
            lambda g, s, p: lossscale.apply_gradients(
                tx,
                grads=g,
                params=p,
                opt_state=s,
                loss_scale=lossscale.StaticLossScale(1.0),
            )
        )
        state = tx.init(PARAMS)
    jax.block_until_ready(step(_grads(), state, PARAMS))
    jax.block_until_ready(step(_grads(bad=True), state, PARAMS))
    jax.effects_barrier()
    expected = [-0.5] if backend_form == "cpu" else [-0.5, float("inf")]
    assert calls == expected, (backend_form, calls)


@pytest.mark.parametrize("entry", ["wrap", "apply_gradients"])
def test_a_skipped_step_keeps_complex_parameters_bit_for_bit(backend_form, entry):
    # Signed zeros in both parts: a skip's updates must be -0.0 in both, since
    # `-0.0 + 0.0` is `+0.0`.
    params = jnp.array([complex(-0.0, -0.0), complex(1.5, -0.0), 0.0, -2j], "complex64")
    grads = jnp.array([complex(jnp.inf, 0.0), 1.0, 1.0, 1.0], "complex64")
    tx = optax.sgd(0.1)
    if entry == "wrap":
        wrapped = lossscale.wrap(tx, "dynamic")
        updates, _ = jax.jit(wrapped.update)(grads, wrapped.init(params), params)
        new = optax.apply_updates(params, updates)
    else:
        new, *_ = jax.jit(
            lambda g, p, s: lossscale.apply_gradients(
                tx,
                grads=g,
                params=p,
                opt_state=s,
                loss_scale=lossscale.DynamicLossScale(),
            )
        )(grads, params, tx.init(params))
    assert bitwise_equal(new, params), (backend_form, new, params)


def _train_state(tx):
    import flax.linen as nn

    return lossscale.flax.TrainState.create(
        apply_fn=nn.Dense(1).apply,
        params=PARAMS,
        tx=tx,
        loss_scale=lossscale.StaticLossScale(1.0),
    )


@pytest.mark.parametrize(
    "tx",
    [
        optax.adam(1e-2),
        optax.chain(
            optax.clip_by_global_norm(1.0),
            optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)),
        ),
    ],
    ids=["adam", "scheduled-chain"],
)
def test_apply_gradients_and_train_state_are_wrap_and_apply_updates(backend_form, tx):
    wrapped = lossscale.wrap(tx, lossscale.DynamicLossScale(4.0))

    @jax.jit
    def by_wrap(params, state, grads):
        updates, state = wrapped.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    @jax.jit
    def by_apply(params, opt_state, loss_scale, grads):
        return lossscale.apply_gradients(
            tx, grads=grads, params=params, opt_state=opt_state, loss_scale=loss_scale
        )

    @jax.jit
    def by_train_state(train_state, grads):
        return train_state.apply_gradients(grads=grads)

    params, state = PARAMS, wrapped.init(PARAMS)
    applied, opt_state, loss_scale = PARAMS, tx.init(PARAMS), wrapped.init(PARAMS)[0]
    train_state = _train_state(tx).replace(loss_scale=loss_scale)
    for k, bad in enumerate([False, False, True, False]):
        grads = {name: g * (4.0 + k) for name, g in _grads(bad).items()}
        params, state = by_wrap(params, state, grads)
        applied, opt_state, loss_scale = by_apply(applied, opt_state, loss_scale, grads)
        train_state = by_train_state(train_state, grads)
        assert bitwise_equal(applied, params), (k, applied, params)
        assert bitwise_equal(opt_state, state.inner_state), k
        assert bitwise_equal(loss_scale, state.loss_scale), k
        assert bitwise_equal(train_state.params, params), (k, train_state.params)
        assert bitwise_equal(train_state.opt_state, state.inner_state), k
    assert int(loss_scale.skipped_steps) == 1


def _normalised(text):
    return re.sub(r"\s+", " ", text).strip()


def _statement():
    guide = (ROOT / "docs/guides/wrap.md").read_text()
    found = re.search(r"<!-- exactness -->\n(.*?)\n<!-- /exactness -->", guide, re.S)
    assert found, "docs/guides/wrap.md has no <!-- exactness --> block"
    return _normalised(found.group(1))


@pytest.mark.parametrize(
    "where",
    [
        "README.md",
        "docs/guides/one_call_step.md",
        "lossscale.wrap",
        "lossscale.apply_gradients",
    ],
)
def test_the_statement_is_the_same_everywhere(where):
    if where.endswith(".md"):
        text = (ROOT / where).read_text()
    else:
        text = getattr(lossscale, where.split(".")[1]).__doc__
    assert _statement() in _normalised(text), (
        f"{where} does not hold the exactness statement of docs/guides/wrap.md"
        f" word for word:\n{_statement()}"
    )


def test_the_statement_names_each_form_and_each_clause_tested_here():
    statement = _statement()
    for clause in ("XLA:CPU", "GPUs and TPUs", "callback", "bit for bit"):
        assert clause in statement, clause
