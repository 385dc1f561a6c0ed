"""The peers' recipes, shared by the benchmark scripts: each applies the gradients
of a scaled loss as the peer's documentation does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def jmp_apply(tx, params, opt_state, loss_scale, scaled_grads):
    """jmp's README: unscale, check, adjust, then `select_tree` over both trees."""
    import jmp

    grads = loss_scale.unscale(scaled_grads)
    finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(finite)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, opt_state = jmp.select_tree(
        finite, (new_params, new_opt_state), (params, opt_state)
    )
    return params, (opt_state, loss_scale)


def flax_apply_or_keep(state, is_finite, grads):
    """Flax's recipe after `DynamicScale.value_and_grad`: apply the gradients, then
    keep the old params and optimizer state where they were not finite (a select
    over both, as Flax's examples do)."""
    new_state = state.apply_gradients(grads=grads)
    select = lambda a, b: jnp.where(is_finite, a, b)  # noqa: E731
    return new_state.replace(
        opt_state=jax.tree.map(select, new_state.opt_state, state.opt_state),
        params=jax.tree.map(select, new_state.params, state.params),
    )


def keras_optimizer(params, *, learning_rate, initial_scale, clipnorm=None):
    """Keras 3's `LossScaleOptimizer` around Adam, built for `params`.

    Returns `apply(params, optimizer_variables, scaled_grads)`, which runs its
    stateless API and returns `(params, optimizer_variables)`, and the initial
    optimizer variables.
    """
    import keras

    leaves, treedef = jax.tree.flatten(params)
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(learning_rate, global_clipnorm=clipnorm),
        initial_scale=initial_scale,
    )
    optimizer.build([keras.Variable(leaf) for leaf in leaves])

    def apply(params, optimizer_variables, scaled_grads):
        new_leaves, optimizer_variables = optimizer.stateless_apply(
            optimizer_variables, jax.tree.leaves(scaled_grads), jax.tree.leaves(params)
        )
        return jax.tree.unflatten(treedef, new_leaves), optimizer_variables

    return apply, [v.value for v in optimizer.variables]
