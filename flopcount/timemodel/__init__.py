"""The fitted time model: how long an op, a step or a token takes on a device, beside the bare roofline.

``core`` prices one op from numbers alone (waves of tiles over the SMs, the bandwidth ramp, the kernel floors, the
host's launches) and imports neither torch nor pandas; ``params`` reads the fitted parameters
(``data/time_model.json``); ``predict`` and ``generation`` apply the model to a counted step or generation;
``calls``, ``oncalls``, ``device`` and ``versus`` to the op calls of a recorded profile (``trace|nsys --predict``);
``fit`` fits the parameters and measures the error. See the docs' "Predicted time" page (docs/guide/predict.md).
"""
