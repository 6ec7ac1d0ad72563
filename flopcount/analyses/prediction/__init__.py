"""Predicted time: the fitted time model (``flopcount.device.timemodel``) applied to a counted step (``predict``),
a generation (``generation``) or the op calls of a recorded profile (``calls``, ``oncalls``, ``versus``: ``trace|nsys
--predict``)."""
