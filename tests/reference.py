"""An independent pure-Python model of the dynamic loss-scale rule.

Written from the specification (TF/Keras' DynamicLossScale with Megatron-LM's
hysteresis), not from the implementation: an unbounded overflow tracker, explicit
if/else, numpy float32 arithmetic for the scale.
"""

import numpy as np


class ReferenceDynamicRule:
    def __init__(
        self,
        scale=2.0**15,
        growth_interval=2000,
        growth_factor=2.0,
        backoff_factor=0.5,
        min_scale=1.0,
        max_scale=2.0**24,
        hysteresis=1,
    ):
        self.scale = np.float32(scale)
        self.growth_interval = growth_interval
        self.growth_factor = np.float32(growth_factor)
        self.backoff_factor = np.float32(backoff_factor)
        self.min_scale = np.float32(min_scale)
        self.max_scale = np.float32(max_scale)
        self.hysteresis = hysteresis
        self.counter = 0
        self.overflows = 0  # since the last growth, never capped
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.forward_overflows = 0
        self.stuck = False

    def step(self, finite: bool, loss_finite: bool = True) -> bool:
        """Advances one step; returns whether the update is applied."""
        self.stuck = False
        if not loss_finite:
            # A forward overflow: skipped and counted, the scale rule untouched.
            self.skipped_steps += 1
            self.consecutive_skips += 1
            self.forward_overflows += 1
            return False
        if finite:
            self.consecutive_skips = 0
            self.counter += 1
            if self.counter == self.growth_interval:
                grown = self.scale * self.growth_factor
                self.scale = grown if grown < self.max_scale else self.max_scale
                self.counter = 0
                self.overflows = 0
            return True
        self.skipped_steps += 1
        self.consecutive_skips += 1
        self.stuck = self.scale == self.min_scale
        self.counter = 0
        self.overflows += 1
        if self.overflows >= self.hysteresis:
            reduced = self.scale * self.backoff_factor
            self.scale = reduced if reduced > self.min_scale else self.min_scale
        return False
