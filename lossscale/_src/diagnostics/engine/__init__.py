"""The jaxpr engine the diagnostics share: a program traced, interpreted, probed.

`program` traces a loss function's forward and backward pass to a jaxpr (through
`jax.make_jaxpr`); `interpret` evaluates it equation by equation, in float16 and in
float32; `probe` runs it at chosen loss scales. It imports nothing of what uses it
(`preflight`, `locate`, `*_hazards`): `lint-imports` holds it.
"""
