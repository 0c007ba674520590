"""Sharded training on TorchRec: one DLRM trained by N processes (`checknrun train --nproc N`).

plan.py     how the tables are split over the ranks (the planner and its sharder)
model.py    the sharded DLRM, its initial rows and each rank's local shards
data.py     a rank's part of a global batch, as TorchRec's KeyedJaggedTensor
loop.py     the training loop every rank runs, with the checkpointer's seam
launch.py   the processes: spawned here or started by torchrun, and their teardown
job.py      one rank's job: the stream, model and optimizers `train` options describe
"""

#: the `--sharding` choices: every table whole on one rank, or split by rows over all ranks.
SHARDINGS = ("table_wise", "row_wise")
