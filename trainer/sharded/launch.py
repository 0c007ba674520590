"""The processes of a sharded job: N ranks spawned on this host, or started by torchrun.

    checknrun train --nproc 2 --data ratings.csv ...                    # spawns 2 ranks here
    torchrun --nproc-per-node 2 -m trainer.sharded.launch --data ratings.csv ...   # same job

`--nproc N` spawns N processes (gloo on CPU, NCCL on GPUs) that meet on a free port of
127.0.0.1; under torchrun each process reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT from the environment. One failing rank stops the job: the spawner terminates the
others and raises `RankFailedError` with the error of the rank that failed first (not the
"Connection closed by peer" its peers then see); torchrun stops the others itself.

Teardown: a rank that finished waits at a barrier for the others, then destroys its process
groups, before the interpreter exits, so no rank closes its connections under a peer still in
a collective, and no process group is left for the interpreter's exit to destroy. (A probe
that destroyed its group without the barrier once ended with `terminate called without an
active exception`, SIGABRT, at exit; that did not recur in 12 reruns here, and the tests check
that no job's stderr says it.)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from torch.multiprocessing.spawn import (
    ProcessExitedException,
    ProcessRaisedException,
    start_processes,
)

from publisher.cli import (
    REPORTED,
    CommandError,
    CommandParser,
    parse_command_line,
    report_failure,
)
from schemas.errors import CheckNRunError
from trainer.errors import RankFailedError
from trainer.options import add_train_args
from trainer.sharded.job import check_job_options, train_rank

#: how long a collective waits for a peer before the rank fails (a dead or stuck rank).
DEFAULT_TIMEOUT_S = 300.0

#: what a rank runs once its process group is up: fn(rank, world_size, local_rank).
RankMain = Callable[[int, int, int], None]


def spawn_ranks(
    main: RankMain, nproc: int, *, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S
) -> None:
    """Run `main` in `nproc` new processes on this host; returns when all finished, or raises
    `RankFailedError` for the rank that failed first (the others are terminated)."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="checknrun-ranks-") as failures:
        try:
            context = start_processes(  # type: ignore[no-untyped-call]
                _spawned_rank,
                args=(nproc, main, backend, init_method, timeout_s, Path(failures)),
                nprocs=nproc,
                join=False,
                start_method="spawn",
            )
            with _signals_to_ranks(context.pids()):
                while not context.join():
                    pass
        except (ProcessRaisedException, ProcessExitedException) as exc:
            raise RankFailedError(_first_failure(exc, Path(failures))) from None


@contextmanager
def _signals_to_ranks(pids: Sequence[int]) -> Iterator[None]:
    """While the ranks run: SIGTERM to this process goes to every rank (the job's ranks stop
    together and publish a final version, trainer/sharded/step_votes.py), and Ctrl-C, which the
    terminal sends the ranks too, leaves the spawner waiting for them to finish."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: object) -> None:
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signum)

    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, forward),
        signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
    }
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _spawned_rank(
    rank: int,
    world_size: int,
    main: RankMain,
    backend: str,
    init_method: str,
    timeout_s: float,
    failures: Path,
) -> None:
    def record(exc: BaseException) -> None:
        # When it failed (a monotonic clock all processes share), before its teardown: its
        # peers fail next, when their collectives lose it, and the job's error is the first.
        failed = {"at": time.monotonic(), "error": f"{type(exc).__name__}: {exc}"}
        # Whole or not at all: the spawner terminates the other ranks as soon as one fails,
        # maybe while this one writes (a half-written record once failed the job's report).
        partial = failures / f"{rank}.json.part"
        partial.write_text(json.dumps(failed))
        os.replace(partial, failures / f"{rank}.json")

    run_rank(
        main,
        rank,
        world_size,
        rank,
        backend=backend,
        init_method=init_method,
        timeout_s=timeout_s,
        on_failure=record,
    )


def _first_failure(exc: ProcessRaisedException | ProcessExitedException, failures: Path) -> str:
    """What stopped the job: a rank that died without raising (the spawner saw it exit first),
    else the rank whose exception came first."""
    raised = {int(path.stem): json.loads(path.read_text()) for path in failures.glob("*.json")}
    # (a record being written when its rank was terminated is a `.part` file: not read)
    if isinstance(exc, ProcessExitedException) and exc.error_index not in raised:
        return f"rank {exc.error_index} died: {_exit_reason(exc.exit_code)}"
    if not raised:
        return f"rank {exc.error_index} failed: {_last_line(exc.msg)}"
    rank = min(raised, key=lambda r: float(raised[r]["at"]))
    return f"rank {rank} failed: {' '.join(str(raised[rank]['error']).split())}"


def run_rank(
    main: RankMain,
    rank: int,
    world_size: int,
    local_rank: int,
    *,
    backend: str,
    init_method: str = "env://",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    on_failure: Callable[[BaseException], None] | None = None,
) -> None:
    """Join the job's process group, run `main`, and tear down cleanly (module docstring);
    `on_failure` sees the exception `main` raised before the teardown."""
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        main(rank, world_size, local_rank)
        dist.barrier()
    except Exception as exc:
        if on_failure is not None:
            on_failure(exc)
        if not isinstance(exc, CheckNRunError):
            traceback.print_exc()  # a bug: its traceback, as a single process shows it
        raise
    finally:
        # A failed rank skips the barrier (its peers may be gone) but still destroys the groups,
        # so the error is what ends the process, not an abort at exit.
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (rank 0 binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _last_line(traceback_text: str) -> str:
    """The `Type: message` line that ends a formatted traceback."""
    lines = [line for line in traceback_text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "unknown error"


def _exit_reason(exit_code: int) -> str:
    if exit_code < 0:
        try:
            return f"killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            return f"killed by signal {-exit_code}"
    return f"exit status {exit_code}"


def run_job(args: argparse.Namespace) -> int:
    """`checknrun train --nproc N`: the job's N ranks on this host; returns the exit status."""
    check_job_options(args, args.nproc)
    backend = "nccl" if args.device == "cuda" else "gloo"  # as under torchrun
    spawn_ranks(functools.partial(train_rank, args), args.nproc, backend=backend)
    return 0


def torchrun_rank(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    """This process's rank of a job torchrun started: the `train` options, RANK, WORLD_SIZE,
    LOCAL_RANK (and MASTER_ADDR/MASTER_PORT for the process group) from `environ`."""
    parser = CommandParser(prog="python -m trainer.sharded.launch")
    add_train_args(parser)
    args = parse_command_line(parser, argv)
    try:
        missing = [name for name in ("RANK", "WORLD_SIZE") if name not in environ]
        if missing:
            raise CommandError(f"{', '.join(missing)} not set: start this module with torchrun")
        rank, world_size = int(environ["RANK"]), int(environ["WORLD_SIZE"])
        if args.nproc not in (None, world_size):
            raise CommandError(f"--nproc {args.nproc}, but torchrun started {world_size} ranks")
        check_job_options(args, world_size)
        run_rank(
            functools.partial(train_rank, args),
            rank,
            world_size,
            int(environ.get("LOCAL_RANK", rank)),
            backend="nccl" if args.device == "cuda" else "gloo",
        )
    except (*REPORTED, KeyboardInterrupt) as exc:
        return report_failure(parser.prog, exc, as_json=args.json)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`torchrun ... -m trainer.sharded.launch [train options]`: this process's rank of the job."""
    return torchrun_rank(sys.argv[1:] if argv is None else argv, os.environ)


if __name__ == "__main__":
    sys.exit(main())
