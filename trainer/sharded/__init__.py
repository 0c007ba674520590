"""A TorchRec model sharded over the ranks of a job: its collective, checkpoints and restore."""
