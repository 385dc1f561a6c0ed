"""`check_config`: a restore must use the loss scale its checkpoint was written with.

A checkpoint of a train state saves the loss-scale state's arrays (the dynamic
scale and the counters) but not its static settings, which live in the code: a
static scale and a no-op scale even have the same arrays. Saving
`state.get_config()` next to the arrays lets a restore check that the code's loss
scale is the one the checkpoint was written with.
"""

from __future__ import annotations

from typing import Any

from lossscale._src import lookup
from lossscale._src.base import LossScale


def check_config(saved: dict[str, Any], loss_scale: Any) -> None:
    """Raises `ValueError` if `loss_scale` differs from the saved config.

    Call it before restoring a checkpoint, with the dict `get_config()` returned
    when it was written. A checkpoint's arrays alone cannot tell a static scale
    from another static scale or from no scaling, and they never hold the dynamic
    settings, so without this check such a restore would silently continue with
    other settings.

    Args:
      saved: the dict `get_config()` returned when the checkpoint was written.
      loss_scale: the loss scale the code restores into: a state, or a tree
        holding one (an optimizer state, a train state).

    Raises:
      ValueError: if the kinds or settings differ (the message lists the
        differences and the migration path), `saved` is not a config, or
        `loss_scale` holds no state (or several).
      TypeError: if `loss_scale` is a spec (a number, "dynamic" or None).

    Examples:
      >>> import lossscale
      >>> saved = lossscale.DynamicLossScale().get_config()
      >>> lossscale.check_config(saved, lossscale.DynamicLossScale())
      >>> try:
      ...     lossscale.check_config(saved, lossscale.StaticLossScale(1024))
      ... except ValueError as error:
      ...     print(str(error).splitlines()[0])
      The checkpoint was written with another loss scale than the code's:
    """
    # Rebuilt, so that the comparison sees the values the constructor keeps
    # (settings in float32, as the rules compute).
    expected = LossScale.from_config(saved).get_config()
    current = lookup.find(loss_scale, "loss_scale").get_config()
    if current == expected:
        return
    differences = [
        f"  {key}: checkpoint {expected.get(key, '(absent)')!r},"
        f" code {current.get(key, '(absent)')!r}"
        for key in sorted(set(expected) | set(current))
        if expected.get(key) != current.get(key)
    ]
    raise ValueError(
        "The checkpoint was written with another loss scale than the code's:\n"
        + "\n".join(differences)
        + "\nTo restore it as it was, build the target with"
        " `lossscale.LossScale.from_config(saved)`. To change the loss scale,"
        " restore that way and then replace the loss-scale state (e.g."
        " `state.replace(loss_scale=new)`); the saved counters do not carry over to"
        " another kind."
    )
