"""What every process of a run shares: its directory's files and records, resuming, fail
points, process setup and torch.distributed."""
