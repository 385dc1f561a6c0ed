"""The diagnostics, and the jaxpr engine they share.

`locate_overflow`, `preflight`, `preflight_step`; the engine (`engine/`: `program`,
`interpret`, `probe`), which imports none of them. May import the entry points, the step
and the state; never the compatibility code.
"""
