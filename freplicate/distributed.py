"""Multi-process data parallelism on torch.distributed (being written: issue 4)."""
