"""Private implementation of lossscale: import from `lossscale` instead."""
