"""The device: peaks (datasheet and policy), the CPU probe, timing, and the fitted time model."""
