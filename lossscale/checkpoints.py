"""Checkpoints: checking a restore's loss scale, and reading older versions' states.

A checkpoint saves a loss-scale state's arrays but not its static settings, which
live in the code: save `state.get_config()` beside it, and `check_config` tells a
restore whether the code's loss scale is the one the checkpoint was written with.
A checkpoint written by lossscale 0.2 or 0.3.0 holds other leaves in a state's
place: restore it into `layout(target, version)` and pass what comes back to
`upgrade`. Guide: `docs/guides/checkpoints.md`.
"""

from lossscale._src.compat.checkpoints import check_config
from lossscale._src.compat.versions import layout
from lossscale._src.compat.versions import upgrade

__all__ = ("check_config", "layout", "upgrade")
