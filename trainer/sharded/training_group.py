"""Reductions over the training group, on the device its backend reduces.

The checkpointer's collectives at a step boundary (the dirty-row bitmaps, a chunked full's
chunk count) run on the training thread's group, between the training collectives: NCCL, on GPU
ranks, reduces device tensors only; gloo reduces host tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_max(values: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The element-wise maximum of every rank's `values` (a host tensor), on the host (a
    collective call: every rank makes it)."""
    if dist.get_backend(group) == "nccl":
        on_device = values.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(on_device, op=dist.ReduceOp.MAX, group=group)
        return on_device.cpu()
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return values
