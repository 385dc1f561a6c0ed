"""The guarded step: check the gradients, unscale them, apply or skip the update.

Holds the check (`finite`) and its reduction in each backend's form (`forms`), the
unscaling (`unscaling`), Flax's fp8 collection (`fp8`) and the step in each
backend's form (`step`). Imports the state and the shared `checks`: no entry point,
diagnostic or compatibility code.
"""
