"""The guarded step: check the gradients, unscale them, apply or skip the update.

Holds the check (`finite`), the unscaling (`unscaling`), Flax's fp8 collection
(`fp8`), the split of the step into each backend's form (`split`) and the step
(`step`). Imports the state and the shared `checks`: no entry point, diagnostic or
compatibility code.
"""
