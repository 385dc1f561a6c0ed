"""Loss scaling for mixed-precision training in JAX, as optax transformations.

Multiply the loss by a scale before differentiating (`scale_loss`), divide the
gradients by it afterwards (`unscale_grads`), and skip the steps whose gradients
overflow while the scale adapts (`update`). `wrap` does all of it around any optax
transformation.
"""

from lossscale._src.apply import apply_gradients
from lossscale._src.config import check_config
from lossscale._src.config import config
from lossscale._src.config import from_config
from lossscale._src.grad import value_and_grad
from lossscale._src.grad_stats import grad_stats
from lossscale._src.loss_scale import DynamicLossScale
from lossscale._src.loss_scale import LossScale
from lossscale._src.loss_scale import LossScaleLike
from lossscale._src.loss_scale import NoOpLossScale
from lossscale._src.loss_scale import StaticLossScale
from lossscale._src.loss_scale import get_loss_scale
from lossscale._src.loss_scale import update
from lossscale._src.metrics import metrics
from lossscale._src.scaling import all_finite
from lossscale._src.scaling import scale_loss
from lossscale._src.scaling import select_tree
from lossscale._src.scaling import unscale_grads
from lossscale._src.wrapper import WrapState
from lossscale._src.wrapper import wrap

__version__ = "0.1.0"

__all__ = (
    "DynamicLossScale",
    "LossScale",
    "LossScaleLike",
    "NoOpLossScale",
    "StaticLossScale",
    "WrapState",
    "all_finite",
    "apply_gradients",
    "check_config",
    "config",
    "from_config",
    "get_loss_scale",
    "grad_stats",
    "metrics",
    "scale_loss",
    "select_tree",
    "unscale_grads",
    "update",
    "value_and_grad",
    "wrap",
)
