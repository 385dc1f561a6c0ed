"""tunix integration of loss scaling (needs the `tunix` extra).

tunix's trainers own the train step. Give one `wrap(tx)` as its optimizer and call
`scale_trainer(trainer)`: its step then scales the loss, skips non-finite steps,
logs the unscaled loss and gradient norm with the loss scale and the skips, and
accumulates micro-batches inside the wrap. Tested with the google-tunix releases
in `TESTED_TUNIX`. Import this module explicitly (`import lossscale.tunix`);
`import lossscale` alone never imports tunix or Flax. Guide: `docs/guides/tunix.md`.
"""

from lossscale._src.api.tunix_training import TESTED_TUNIX
from lossscale._src.api.tunix_training import scale_trainer
from lossscale._src.api.tunix_training import wrap

__all__ = ("TESTED_TUNIX", "scale_trainer", "wrap")
