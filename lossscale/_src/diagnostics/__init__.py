"""The diagnostics, and the jaxpr engine they share.

`locate_overflow`, `preflight`, `preflight_step`, `grad_stats`, `metrics`, `leaf_path`;
the engine: `program`, `interpret`, `probe`. May import the entry points, the step
and the state; never the compatibility code.
"""
