"""The loss-scale state: `LossScale`, `field`, the built-in kinds and their rule.

Holds what a state is (`kind`, `kind_fields`, `kind_validation`), the kinds
(`kinds`) and how a state moves after a step (`update`). Imports only `checks` and
`deprecation`: no step, entry point, diagnostic or compatibility code.
"""
