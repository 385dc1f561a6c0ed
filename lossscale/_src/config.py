"""The kind and settings of a loss scale as JSON, for checkpoints.

A checkpoint of a train state saves the loss-scale state's arrays (the dynamic
scale and the counters) but not its static settings, which live in the code: a
static scale and a no-op scale even have the same arrays. Saving `config(state)`
next to the arrays lets a restore check that the code's loss scale is the one the
checkpoint was written with.
"""

from __future__ import annotations

from typing import Any

from lossscale._src import loss_scale as loss_scale_lib

_KINDS = {
    "none": loss_scale_lib.NoOpLossScale,
    "static": loss_scale_lib.StaticLossScale,
    "dynamic": loss_scale_lib.DynamicLossScale,
}


def config(loss_scale: Any) -> dict[str, Any]:
    """Returns the kind and settings of a loss scale as a JSON-serialisable dict.

    Save it with the checkpoint (e.g. as an Orbax `JsonSave` item) and give it to
    `check_config` when restoring.

    Args:
      loss_scale: a loss-scale state or spec, or an optimizer or train state
        holding one.

    Returns:
      `{"kind": "none" | "static" | "dynamic", **settings}`; the scale and the
      counters, which change during training, are not part of it.

    Examples:
      >>> import lossscale
      >>> print(lossscale.config(lossscale.StaticLossScale(1024)))
      {'kind': 'static', 'scale': 1024.0}
      >>> print(lossscale.config(None))
      {'kind': 'none'}
    """
    state = loss_scale_lib.resolve_loss_scale(loss_scale)
    kind = next(name for name, cls in _KINDS.items() if type(state) is cls)
    settings = {
        name.lstrip("_"): getattr(state, name) for name in state._setting_fields
    }
    return {"kind": kind, **settings}


def from_config(saved: dict[str, Any]) -> loss_scale_lib.LossScale:
    """Returns a fresh loss-scale state of the kind and settings in `saved`.

    Use it to build the restore target of a checkpoint written with other
    loss-scale settings than the code's: restore with it, then replace the
    restored loss-scale state with the one wanted.

    Args:
      saved: a dict from `config`.

    Returns:
      A new state with those settings; a dynamic one starts at the scale nearest
      2**15 within its bounds (a restore overwrites it).

    Raises:
      ValueError: if `saved` is not a dict from `config`.

    Examples:
      >>> import lossscale
      >>> print(lossscale.from_config({"kind": "static", "scale": 8.0}).scale)
      8.0
    """
    if not isinstance(saved, dict) or saved.get("kind") not in _KINDS:
        raise ValueError(
            "`saved` must be a dict from `lossscale.config`, with 'kind' one of"
            f" {sorted(_KINDS)}; got {saved!r}."
        )
    settings = {key: value for key, value in saved.items() if key != "kind"}
    cls = _KINDS[saved["kind"]]
    expected = {name.lstrip("_") for name in cls._setting_fields}
    if set(settings) != expected:
        raise ValueError(
            f"`saved` for kind {saved['kind']!r} must have the settings"
            f" {sorted(expected)}, got {sorted(settings)}."
        )
    if cls is loss_scale_lib.DynamicLossScale:
        initial = min(max(2.0**15, settings["min_scale"]), settings["max_scale"])
        return cls(initial_scale=initial, **settings)
    return cls(**settings)


def check_config(saved: dict[str, Any], loss_scale: Any) -> None:
    """Raises `ValueError` if `loss_scale` differs from the saved `config`.

    Call it before restoring a checkpoint, with the config saved beside it. A
    checkpoint's arrays alone cannot tell a static scale from another static scale
    or from no scaling, and they never hold the dynamic settings, so without this
    check such a restore would silently continue with other settings.

    Args:
      saved: the dict `config` returned when the checkpoint was written.
      loss_scale: the loss scale the code restores into: a state or spec, or an
        optimizer or train state holding one.

    Raises:
      ValueError: if the kinds or settings differ; the message lists the
        differences and the migration path.

    Examples:
      >>> import lossscale
      >>> saved = lossscale.config("dynamic")
      >>> lossscale.check_config(saved, lossscale.DynamicLossScale())
      >>> try:
      ...     lossscale.check_config(saved, 1024.0)
      ... except ValueError as error:
      ...     print(str(error).splitlines()[0])
      The checkpoint was written with another loss scale than the code's:
    """
    saved_state = from_config(saved)
    current = config(loss_scale)
    expected = config(saved_state)
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
        " `lossscale.from_config(saved)`. To change the loss scale, restore that"
        " way and then replace the loss-scale state (e.g."
        " `state.replace(loss_scale=new)`); the saved counters do not carry over to"
        " another kind."
    )
