"""What each process of `--workers` holds of the others, made by the launcher before any worker
starts (server/workers/processes.py): the gate, and a control pipe (syncs one way,
acknowledgements back) and an RPC pipe (questions one way, answers back) per worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.workers.gate import ReadGate
from server.workers.shared_slot import WorkerPipes


@dataclass
class WorkerEnd:
    """A worker's ends (picklable to the spawned worker)."""

    gate: ReadGate
    control: Any  # multiprocessing Connection: receives syncs, sends acknowledgements
    rpc: Any  # multiprocessing Connection: sends questions, receives answers


@dataclass
class ApplySideEnds:
    """The apply side's ends: its gate (index 0), the control pipes, the RPC pipes."""

    gate: ReadGate
    pipes: WorkerPipes
    rpcs: list[Any]


def make_links(ctx: Any, processes: int) -> tuple[ApplySideEnds, list[WorkerEnd]]:
    """The links of `processes` processes (the apply side and processes - 1 workers), with
    `ctx`'s (a multiprocessing context's) locks, shared values and pipes."""
    from server.workers.gate import SLOTS

    locks = [ctx.Lock() for _ in range(processes)]
    live = ctx.RawValue("q", 0)
    busy = ctx.RawArray("q", processes * SLOTS)
    controls = [ctx.Pipe() for _ in range(processes - 1)]
    rpcs = [ctx.Pipe() for _ in range(processes - 1)]
    apply_side = ApplySideEnds(
        ReadGate(0, locks, live, busy),
        WorkerPipes([mine for mine, _ in controls]),
        [mine for mine, _ in rpcs],
    )
    workers = [
        WorkerEnd(ReadGate(w, locks, live, busy), controls[w - 1][1], rpcs[w - 1][1])
        for w in range(1, processes)
    ]
    return apply_side, workers
