"""The fitted time model: how long one op takes on a device, from numbers alone.

``core`` prices one op (waves of tiles over the SMs, the bandwidth ramp, the kernel floors, the host's launches) and
imports neither torch nor pandas; ``params`` reads the fitted parameters (``data/time_model.json``); ``shapes`` and
``record`` note the products inside an op during a count; ``trace_device`` names a profile's device; ``fit`` fits
the parameters on real profiles and measures the error. Applying the model to a step, a generation or a profile is an
analysis: ``flopcount.analyses.prediction``.
"""
