"""Fault injection for the crash tests: die by SIGKILL at a named step of the commit protocol.

Set `CHECKNRUN_FAULT_KILL_AT=STAGE[:N]` in a trainer's environment to kill the process the N-th
time (default 1st) it reaches STAGE, one of `blob_written`, `blobs_done`, `manifest_written`,
`head_moved` (see version_writer.CommitStage). SIGKILL, not an exception: nothing gets to clean
up, exactly like a machine failure. Unset, this costs one dictionary lookup per stage.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

ENV_VAR = "CHECKNRUN_FAULT_KILL_AT"
_seen: Counter[str] = Counter()


def fault_point(stage: str) -> None:
    """Kill this process if the environment asks for a crash at this stage."""
    spec = os.environ.get(ENV_VAR)
    if not spec:
        return
    wanted, _, nth = spec.partition(":")
    if wanted != stage:
        return
    _seen[stage] += 1
    if _seen[stage] == (int(nth) if nth else 1):
        os.kill(os.getpid(), signal.SIGKILL)
