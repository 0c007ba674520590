"""The background publisher's CPU priority: below the training thread's.

A trainer's publisher (encode, zstd, hashing, uploads, the served-loss scoring) shares the
machine with the training thread. When they want the same core, the kernel's scheduler should
run the training thread: a version published a few milliseconds later costs nothing, a training
step stalled costs throughput. So the publisher's threads, and a publisher process, can run at
a higher nice value (`Tunables.publisher_nice`; at 10 CFS gives the training thread ~90% of a
contended core). When a core is free the publisher runs at full speed all the same.

It is off by default (0): on a machine whose cores are all busy (a live trainer with its event
reader on 2 cores) the lowered publisher falls behind, snapshots queue and merge, and fewer
versions are published: fresher serving was worth more than the training time, which this
machine could not show to be larger than its own drift (README, Benchmarks).

On Linux the nice value belongs to a thread (setpriority with the thread's own id), and a
thread starts with its creator's, so the upload pool a publisher thread creates inherits it.
Elsewhere setpriority would renice the whole process, the training thread too, so nothing is
changed there. Raising a nice value needs no privilege; a refusal leaves the priority as it was.
"""

from __future__ import annotations

import os
import sys
import threading

__all__ = ["PER_THREAD", "lower_this_thread", "this_thread_nice"]

#: whether a thread's nice value is its own (Linux), so it can be lowered for one thread.
PER_THREAD = sys.platform.startswith("linux") and hasattr(os, "setpriority")

_MAX_NICE = 19


def this_thread_nice() -> int | None:
    """The calling thread's nice value; None where it is not a thread's own."""
    if not PER_THREAD:
        return None
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def lower_this_thread(by: int) -> int | None:
    """Raise the calling thread's nice value by `by` (at most to 19); return the new value, or
    None where nothing changed (`by` <= 0, not Linux, or the kernel refused)."""
    if by <= 0 or not PER_THREAD:
        return None
    tid = threading.get_native_id()
    try:
        nice = min(_MAX_NICE, os.getpriority(os.PRIO_PROCESS, tid) + by)
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:  # a sandbox may refuse it; the publisher works the same, only sooner
        return None
    return nice
