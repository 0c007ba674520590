"""Reductions over the training group, on the device its backend reduces.

The checkpointer's collectives at a step boundary (the dirty-row bitmaps, a chunked full's
chunk count) run on the training thread's group, between the training collectives: NCCL, on GPU
ranks, reduces device tensors only; gloo reduces host tensors.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from trainer.sharded.local_shards import ShardedTable


def all_reduce_max(
    values: torch.Tensor, group: dist.ProcessGroup | None, device: torch.device | None = None
) -> torch.Tensor:
    """The element-wise maximum of every rank's `values` (a host tensor), on the host (a
    collective call: every rank makes it). `device`: the GPU an NCCL group reduces on, the
    one this rank's shards live on (None: the current device)."""
    if dist.get_backend(group) == "nccl":
        on_device = values.to(device or torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(on_device, op=dist.ReduceOp.MAX, group=group)
        return on_device.cpu()
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return values


def shard_devices(tables: Mapping[str, ShardedTable]) -> list[torch.device]:
    """The GPUs this rank's shards of `tables` live on (none on CPU), in a stable order: a
    user's DistributedModelParallel may place them on `cuda:local_rank` without making it the
    current device, so synchronisations and reductions name it."""
    found = {s.weight.device for t in tables.values() for s in t.shards if s.weight.is_cuda}
    return sorted(found, key=str)
