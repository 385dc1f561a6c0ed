"""Scalars for logging the loss-scale state."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from lossscale._src import lookup


def metrics(opt_state_or_loss_scale: Any) -> dict[str, jax.Array]:
    """Returns a dict of scalar arrays describing the loss-scale state, for logging.

    Usable inside `jax.jit`: the values are arrays, nothing is copied to the host.

    Args:
      opt_state_or_loss_scale: a loss-scale state, or any pytree holding exactly
        one (an optimizer state, a `TrainState`, a `lossscale.flax.Optimizer`).

    Returns:
      A dict with the same keys for every kind of loss scale:

      * `loss_scale`: float32, the current scale;
      * `skipped_steps`: int32, non-finite (skipped) steps in total;
      * `forward_overflows`: int32, skipped steps whose loss was not finite
        (reported with `value=` to `wrap`'s update);
      * `backward_overflows`: int32, skipped steps with a finite loss but
        non-finite gradients (the ones a lower scale can fix);
      * `consecutive_skips`: int32, non-finite steps in a row up to the latest;
      * `last_finite`: bool, whether the latest step was applied;
      * `stuck`: bool, the latest step overflowed in the backward pass with the
        scale at its lowest: backing off cannot help; a loop can stop on it.

    Raises:
      TypeError: if given a spec (a number, "dynamic" or None) instead of a state.
      ValueError: if no loss-scale state, or more than one, is found.

    Examples:
      >>> import jax.numpy as jnp, optax, lossscale
      >>> opt_state = lossscale.wrap(optax.sgd(0.1)).init(jnp.zeros(3))
      >>> for name, value in lossscale.metrics(opt_state).items():
      ...     print(name, value)
      loss_scale 32768.0
      skipped_steps 0
      forward_overflows 0
      backward_overflows 0
      consecutive_skips 0
      last_finite True
      stuck False
    """
    state = lookup.find(opt_state_or_loss_scale, "opt_state_or_loss_scale")
    # `jnp.asarray` unwraps containers such as the variables of `nnx.Optimizer`.
    skipped_steps = jnp.asarray(state.skipped_steps)
    forward_overflows = jnp.asarray(state.forward_overflows)
    consecutive_skips = jnp.asarray(state.consecutive_skips)
    return {
        "loss_scale": jnp.asarray(state.scale),
        "skipped_steps": skipped_steps,
        "forward_overflows": forward_overflows,
        "backward_overflows": skipped_steps - forward_overflows,
        "consecutive_skips": consecutive_skips,
        # Derived, not stored: the latest step was applied iff no skip is pending.
        "last_finite": consecutive_skips == jnp.zeros([], jnp.int32),
        "stuck": jnp.asarray(state.stuck),
    }
