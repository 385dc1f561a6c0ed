"""Loss scaling for mixed-precision training in JAX, as optax transformations.

Multiply the loss by a scale before differentiating (`scale_loss`), divide the
gradients by it afterwards (`unscale_grads`), and skip the steps whose gradients
overflow while the scale adapts (`update`). `wrap` does all of it around any optax
transformation, and `apply_gradients` does the whole optimizer step in one call.
Subclass `LossScale` to define a kind of loss scale of your own.

Submodules: `lossscale.diagnostics` (before the first step, `preflight` says what in
a float16 program will fail; after a skip, `locate_overflow` says where),
`lossscale.checkpoints` (checking and reading checkpoints of any version), and the
integrations `lossscale.flax` and `lossscale.tunix` (imported explicitly).
"""

import sys as _sys
import typing as _typing

from lossscale import checkpoints as checkpoints
from lossscale import diagnostics as diagnostics
from lossscale._src.api.apply import apply_gradients
from lossscale._src.api.functional import all_finite
from lossscale._src.api.functional import scale_loss
from lossscale._src.api.functional import unscale_grads
from lossscale._src.api.grad import value_and_grad
from lossscale._src.api.lookup import get_loss_scale
from lossscale._src.api.metrics import metrics
from lossscale._src.api.wrapper import WrapState
from lossscale._src.api.wrapper import wrap
from lossscale._src.state.kind import LossScale
from lossscale._src.state.kind_fields import field
from lossscale._src.state.kinds import DynamicLossScale
from lossscale._src.state.kinds import NoOpLossScale
from lossscale._src.state.kinds import StaticLossScale
from lossscale._src.state.update import update

__version__ = "0.4.0.dev0"

__all__ = (
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "WrapState",
    "all_finite",
    "apply_gradients",
    "field",
    "get_loss_scale",
    "metrics",
    "scale_loss",
    "unscale_grads",
    "update",
    "value_and_grad",
    "wrap",
)

if _typing.TYPE_CHECKING:
    # The names 0.4 moved, which still resolve until 0.5 (with a warning at run
    # time): a user's type checker sees them too.
    from lossscale._src.api.leaf_path import leaf_path as leaf_path
    from lossscale._src.api.metrics import grad_stats as grad_stats
    from lossscale._src.compat.checkpoint_0_3_0 import (
        checkpoint_0_3_0_layout as checkpoint_0_3_0_layout,
    )
    from lossscale._src.compat.checkpoint_0_3_0 import (
        from_checkpoint_0_3_0 as from_checkpoint_0_3_0,
    )
    from lossscale._src.compat.checkpoints import check_config as check_config
    from lossscale._src.compat.checkpoints import (
        checkpoint_0_2_layout as checkpoint_0_2_layout,
    )
    from lossscale._src.compat.checkpoints import (
        from_checkpoint_0_2 as from_checkpoint_0_2,
    )
    from lossscale._src.diagnostics.findings import Finding as Finding
    from lossscale._src.diagnostics.findings import PreflightReport as PreflightReport
    from lossscale._src.diagnostics.locate import OverflowReport as OverflowReport
    from lossscale._src.diagnostics.locate import locate_overflow as locate_overflow
    from lossscale._src.diagnostics.preflight import preflight as preflight
    from lossscale._src.diagnostics.step_check import preflight_step as preflight_step
else:  # to a type checker, a misspelt name is an error

    def __getattr__(name: str):
        # The names 0.4 moved into `diagnostics` and `checkpoints`, and 0.2's
        # removed ones: an alias that warns, or an error naming the new spelling.
        from lossscale._src.compat import compat_0_2
        from lossscale._src.compat import moved

        if name in moved.MOVED or name in moved.RETIRED:
            # `from lossscale import name` asks `hasattr` first, then gets it: one
            # warning, at the second.
            caller = _sys._getframe(1).f_code.co_name
            return moved.module_attribute(name, warn=caller != "_handle_fromlist")
        return compat_0_2.module_attribute(name)
