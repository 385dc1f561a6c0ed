"""The entry points users call.

`wrap`, `apply_gradients`, `value_and_grad`, the functional API (`scale_loss`,
`unscale_grads`, `all_finite`), `get_loss_scale`, and Flax's `TrainState` and
`Optimizer`. Imports the step and the state below it; never a diagnostic or the
compatibility code. Flax is imported only by `flax_training` and
`flax_serialization`, which `lossscale.flax` loads.
"""
