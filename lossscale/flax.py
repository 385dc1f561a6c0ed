"""Flax integrations of loss scaling (needs the `flax` extra).

`TrainState` is Flax linen's `TrainState` with loss scaling; `Optimizer` is
`flax.nnx.Optimizer` with loss scaling. Import this module explicitly
(`import lossscale.flax`); `import lossscale` alone never imports Flax.
"""

from lossscale._src.api.flax_training import Optimizer
from lossscale._src.api.flax_training import TrainState

__all__ = ("Optimizer", "TrainState")
