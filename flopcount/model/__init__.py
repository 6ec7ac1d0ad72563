"""The model and its step: model specs built into a model and inputs, calling a model, the training step."""
