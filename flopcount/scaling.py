"""The batch-scaling check: FLOPs at batch N must be exactly N x batch 1 for every per-sample op."""
