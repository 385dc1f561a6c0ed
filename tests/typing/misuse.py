"""Misuses a type checker must report: each line's ignore fails the check if not.

With `warn_unused_ignores` (mypy) and `reportUnnecessaryTypeIgnoreComment`
(pyright), an ignore that silences nothing is an error: a misuse that stops being
reported fails `tests/test_typing.py`.
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax

import lossscale
import lossscale.flax


def misspelt_names(state: lossscale.DynamicLossScale) -> None:
    lossscale.DynamicLossScal()  # type: ignore[attr-defined]  # pyright: ignore[reportAttributeAccessIssue]
    _ = state.sclae  # type: ignore[attr-defined]  # pyright: ignore[reportAttributeAccessIssue]
    _ = state.growth_intervall  # type: ignore[attr-defined]  # pyright: ignore[reportAttributeAccessIssue]
    lossscale.LossScale.from_confg({"kind": "dynamic"})  # type: ignore[attr-defined]  # pyright: ignore[reportAttributeAccessIssue]


def lossscale_0_2_spellings(state: lossscale.LossScale) -> None:
    # Aliases that warn at run time; errors to a type checker.
    lossscale.select_tree(True, 1, 2)  # type: ignore[attr-defined]  # pyright: ignore[reportAttributeAccessIssue]
    _ = state.lowest_scale  # type: ignore[attr-defined]  # pyright: ignore[reportAttributeAccessIssue]
    lossscale.DynamicLossScale(initial_scale=8.0)  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]
    lossscale.DynamicLossScale(8.0, 1000)  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]


def wrong_arguments() -> None:
    lossscale.DynamicLossScale(scael=8.0)  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]
    lossscale.DynamicLossScale(growth_interval="2000")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    lossscale.DynamicLossScale(growth_interval=2.5)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    lossscale.DynamicLossScale(scale="8")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    lossscale.StaticLossScale()  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]
    lossscale.StaticLossScale(value="1024")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    lossscale.NoOpLossScale(1.0)  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]
    lossscale.NoOpLossScale(scale=1.0)  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]


def frozen(state: lossscale.DynamicLossScale) -> None:
    state.scale = jnp.float32(1.0)  # type: ignore[misc]  # pyright: ignore[reportAttributeAccessIssue]
    state.growth_interval = 10  # type: ignore[misc]  # pyright: ignore[reportAttributeAccessIssue]


def steps(
    tx: optax.GradientTransformation,
    grads: Any,
    params: Any,
    opt_state: Any,
    state: lossscale.DynamicLossScale,
    train_state: lossscale.flax.TrainState,
) -> None:
    lossscale.apply_gradients(tx, grads, params, opt_state, state)  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]
    lossscale.apply_gradients(  # type: ignore[type-var]
        tx,
        grads=grads,
        params=params,
        opt_state=opt_state,
        loss_scale=1024.0,  # pyright: ignore[reportArgumentType]
    )
    lossscale.apply_gradients(tx, grads=grads, params=params, opt_state=opt_state)  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]
    _, _, new = lossscale.apply_gradients(
        tx, grads=grads, params=params, opt_state=opt_state, loss_scale=state
    )
    _ = new.value  # type: ignore[attr-defined]  # pyright: ignore[reportAttributeAccessIssue]
    lossscale.update(1024.0, True)  # type: ignore[type-var]  # pyright: ignore[reportArgumentType]
    _ = lossscale.update(state, True).value  # type: ignore[attr-defined]  # pyright: ignore[reportAttributeAccessIssue]
    train_state.apply_gradients(grads)  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]
    _ = train_state.apply_gradients(grads=grads).loss_scale.sclae  # type: ignore[attr-defined]  # pyright: ignore[reportAttributeAccessIssue]
    lossscale.wrap(tx, loss_scale=[1024.0])  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]


class OwnKind(lossscale.LossScale, kind="typing_test.misuse"):
    scale: jax.Array = lossscale.field(dtype=jnp.float32, default=8.0)

    def rule(self, grads_finite: jax.Array) -> "OwnKind":
        return self


def own_kind() -> None:
    OwnKind(scael=1.0)  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]
    OwnKind(jnp.float32(8.0))  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]
