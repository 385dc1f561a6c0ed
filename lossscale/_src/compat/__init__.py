"""Compatibility and checkpoints.

lossscale 0.2's names and checkpoints (`compat_0_2`, `checkpoints`) and
`check_config`. May import the entry points, the step and the state; never a
diagnostic.
"""
