"""Recording a user's loop: NVTX ranges around steps, phases and modules, and profiles taken with nsys or
torch.profiler."""
