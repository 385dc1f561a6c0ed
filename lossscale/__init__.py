"""Loss scaling for mixed-precision training in JAX, as optax transformations.

Multiply the loss by a scale before differentiating (`scale_loss`), divide the
gradients by it afterwards (`unscale_grads`), and skip the steps whose gradients
overflow while the scale adapts (`update`). `wrap` does all of it around any optax
transformation, and `apply_gradients` does the whole optimizer step in one call.
Before the first step, `preflight` says what in a float16 program will fail.
Subclass `LossScale` to define a kind of loss scale of your own.
"""

import typing as _typing

from lossscale._src.api.apply import apply_gradients
from lossscale._src.api.functional import all_finite
from lossscale._src.api.functional import scale_loss
from lossscale._src.api.functional import unscale_grads
from lossscale._src.api.grad import value_and_grad
from lossscale._src.api.lookup import get_loss_scale
from lossscale._src.api.wrapper import WrapState
from lossscale._src.api.wrapper import wrap
from lossscale._src.compat.checkpoint_0_3_0 import checkpoint_0_3_0_layout
from lossscale._src.compat.checkpoint_0_3_0 import from_checkpoint_0_3_0
from lossscale._src.compat.checkpoints import check_config
from lossscale._src.compat.checkpoints import checkpoint_0_2_layout
from lossscale._src.compat.checkpoints import from_checkpoint_0_2
from lossscale._src.diagnostics.findings import Finding
from lossscale._src.diagnostics.findings import PreflightReport
from lossscale._src.diagnostics.leaf_path import leaf_path
from lossscale._src.diagnostics.locate import OverflowReport
from lossscale._src.diagnostics.locate import locate_overflow
from lossscale._src.diagnostics.preflight import preflight
from lossscale._src.diagnostics.stats import grad_stats
from lossscale._src.diagnostics.stats import metrics
from lossscale._src.diagnostics.step_check import preflight_step
from lossscale._src.state.kind import LossScale
from lossscale._src.state.kind_fields import field
from lossscale._src.state.kinds import DynamicLossScale
from lossscale._src.state.kinds import NoOpLossScale
from lossscale._src.state.kinds import StaticLossScale
from lossscale._src.state.update import update

__version__ = "0.3.0"

__all__ = (
    "DynamicLossScale",
    "Finding",
    "LossScale",
    "NoOpLossScale",
    "OverflowReport",
    "PreflightReport",
    "StaticLossScale",
    "WrapState",
    "all_finite",
    "apply_gradients",
    "check_config",
    "checkpoint_0_2_layout",
    "checkpoint_0_3_0_layout",
    "field",
    "from_checkpoint_0_2",
    "from_checkpoint_0_3_0",
    "get_loss_scale",
    "grad_stats",
    "leaf_path",
    "locate_overflow",
    "metrics",
    "preflight",
    "preflight_step",
    "scale_loss",
    "unscale_grads",
    "update",
    "value_and_grad",
    "wrap",
)

if not _typing.TYPE_CHECKING:  # to a type checker, a misspelt name is an error

    def __getattr__(name: str):
        # lossscale 0.2's removed names: an alias that warns, or an error naming
        # 0.3's.
        from lossscale._src.compat import compat_0_2

        return compat_0_2.module_attribute(name)
