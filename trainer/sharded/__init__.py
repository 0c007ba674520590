"""Sharded training on TorchRec: one DLRM trained by N processes (`checknrun train --nproc N`).

plan.py             how the tables are split over the ranks (the planner and its sharder)
model.py            the sharded DLRM, its initial rows and each rank's local shards
data.py             a rank's part of a global batch, as TorchRec's KeyedJaggedTensor
loop.py             the one training loop every rank runs over a step source, and its seams
step_votes.py       the ranks' vote before each step (stop, checkpoint by time, end, samples)
file_steps.py       a file or data set as a step source: the rank's slice of each global batch
topic_part.py       a live topic as a step source: the rank's partitions and events in hand
step_metrics.py     the progressive metrics of the job's samples, summed at each checkpoint
launch.py           the processes: spawned here or started by torchrun, and their teardown
job.py              one rank's job: the stream, model and optimizers `train` options describe
collective.py       the publisher's Collective over torch.distributed (a gloo group of its own)
local_shards.py     a DMP's table shards and fused accumulators as views, with global shapes
dirty_rows.py       the rows each rank's shards changed (ModelDeltaTracker), and the job's
optimizer_state.py  the fused row-wise optimizer in the one-process trainer's layout
checkpointing.py    ShardedCheckpointer: each rank snapshots its shards, one version per job
host_copies.py      a rank's shard rows copied to host memory: planned rows, or a full in chunks
training_group.py   reductions over the training group (gloo on the host, NCCL on the device)
restore_shards.py   a version into a sharded model at any world size
"""

#: the `--sharding` choices: every table whole on one rank, or split by rows over all ranks.
SHARDINGS = ("table_wise", "row_wise")
