"""Running `checknrun serve --workers N`: one listening socket, N - 1 spawned worker processes,
the apply side in this one, and supervision.

The socket is bound here and handed to every process (uvicorn's own `--workers` does the same),
so the kernel spreads connections over N accept loops. gRPC (`--grpc-port`) binds the same port
in every process (grpc's SO_REUSEPORT); a port 0 is resolved here first, so all agree. Workers
are forked before this process starts a thread of its own (no store, bus, server or apply has
opened yet), with the garbage collector's objects frozen, so that the memory of the imports
is shared rather than repeated per worker (a spawned worker imports its own: measured, 2
processes took 1.95x one's PSS spawned, 1.09x forked).

A worker that exits stops the server (exit status 1): a supervisor restarts it whole, rather
than a server running on fewer cores than it was given without saying so. SIGTERM or SIGINT
stops this process' server; the workers are then stopped with SIGTERM (a graceful uvicorn
shutdown each) and waited for. A worker also gets SIGTERM when this process dies however it
dies (Linux's parent-death signal): uvicorn re-raises the SIGTERM it caught once its server has
stopped, which ends this process before it can stop the workers, and a SIGKILL ends it anyway;
measured before, every such stop left its workers running, orphaned, for good.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
from typing import Any

from publisher.cli_logging import configure_logging
from server.settings import ServerSettings
from server.workers.links import WorkerEnd, make_links

log = logging.getLogger(__name__)

#: how long a stopping worker may take before it is killed.
STOP_TIMEOUT_S = 30.0
#: prctl's option for the signal a process gets when its parent dies (linux/prctl.h).
PR_SET_PDEATHSIG = 1
LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"


def _listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _uvicorn_config(app: Any, log_level: str, settings: ServerSettings) -> Any:
    import uvicorn

    return uvicorn.Config(
        app,
        log_level=log_level,
        access_log=log_level == "debug",
        timeout_graceful_shutdown=int(settings.shutdown_timeout_s),
    )


def _die_with(parent: int) -> None:
    """SIGTERM this process when `parent` dies (see the module docstring); Linux only."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d)", ctypes.get_errno())
    if os.getppid() != parent:  # it died before the signal was asked for
        os.kill(os.getpid(), signal.SIGTERM)


def run_worker(
    settings: ServerSettings, end: WorkerEnd, sock: socket.socket, log_level: str, parent: int
) -> None:
    """A worker process' main (forked): the app on the shared socket, reading mirrors."""
    import uvicorn

    from server.app import create_app

    _die_with(parent)
    configure_logging(log_level.upper(), fmt=LOG_FORMAT)
    app = create_app(settings, worker=end)
    uvicorn.Server(_uvicorn_config(app, log_level, settings)).run(sockets=[sock])


def serve_with_workers(settings: ServerSettings, log_level: str) -> int:
    """Serve with `settings.workers` processes (see the module docstring); the exit status."""
    import torch.multiprocessing  # noqa: F401 (its reductions pass a tensor's shared memory)
    import uvicorn

    from server.app import create_app

    ctx = multiprocessing.get_context("fork")
    sock = _listening_socket(settings.host, settings.port)
    if settings.grpc_port == 0:
        settings = settings.model_copy(update={"grpc_port": _free_port(settings.host)})
    apply_side, ends = make_links(ctx, settings.workers)
    workers = [
        ctx.Process(
            target=run_worker,
            args=(settings, end, sock, log_level, os.getpid()),
            name=f"worker-{end.gate.index}",
        )
        for end in ends
    ]
    gc.freeze()  # what is imported so far stays shared with the workers: no GC writes to it
    for process in workers:
        process.start()
    for end in ends:  # the workers hold their ends now; ours would hide a worker's exit
        end.control.close()
        end.rpc.close()
    app = create_app(settings, apply_side=apply_side)
    server = uvicorn.Server(_uvicorn_config(app, log_level, settings))
    stopping = threading.Event()
    failed: list[str] = []

    def supervise() -> None:
        sentinels = [p.sentinel for p in workers]
        ready = multiprocessing.connection.wait(sentinels)
        if stopping.is_set():
            return
        for process in workers:
            if process.sentinel in ready:
                process.join()
                failed.append(f"{process.name} exited with status {process.exitcode}")
        log.error("%s: stopping the server", "; ".join(failed))
        server.should_exit = True

    threading.Thread(target=supervise, name="supervisor", daemon=True).start()
    log.info("serving with %d processes on %s:%d", settings.workers, *sock.getsockname()[:2])
    try:
        server.run(sockets=[sock])
    finally:
        stopping.set()
        for process in workers:
            if process.is_alive():
                process.terminate()
        for process in workers:
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                log.warning("%s did not stop in %.0f s: killed", process.name, STOP_TIMEOUT_S)
                process.kill()
                process.join()
        sock.close()
    return 1 if failed else 0
