"""The apply side's answers to its workers (server/workers/mirror.py, `RpcClient`): the live
model's status for /v1/model and /readyz, and the admin actions, which only the apply side can
take (it alone follows the versions); a digest is each process' own (mirror.py). One thread
per worker; an exception is sent back and re-raised in the worker, so a pin's 404, 502 or 503
is the same in every process."""

from __future__ import annotations

import logging
import pickle
import threading
from collections.abc import Sequence
from typing import Any

from publisher.read import Subscriber

log = logging.getLogger(__name__)


class ApplySideRpc:
    """Serves the workers' RPC pipes for `subscriber` (see the module docstring)."""

    def __init__(self, subscriber: Subscriber, conns: Sequence[Any]) -> None:
        self.subscriber = subscriber
        self._threads = [
            threading.Thread(target=self._serve, args=(c,), name=f"worker-rpc-{w}", daemon=True)
            for w, c in enumerate(conns, 1)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def answer(self, op: str, arg: object) -> object:
        """What `op` returns (the ops of server/workers/messages.py, RPC_OPS)."""
        live = self.subscriber.live
        if op == "status":
            return {
                "pinned": live.pinned,
                "staleness_s": live.staleness_s(),
                "latest_known": live.latest_known(),
                "versions_applied": live.versions_applied,
                "bytes_fetched": live.bytes_fetched,
                "last_times": live.last_times,
                "nbytes": live.nbytes(),
                "rejected": self.subscriber.rejected,
            }
        if op == "pin":
            assert isinstance(arg, int)
            return live.pin(arg)
        if op == "unpin":
            return live.unpin()
        if op == "catch_up":
            self.subscriber.request_catch_up()
            return None
        raise ValueError(f"unknown worker request {op!r}")

    def _serve(self, conn: Any) -> None:
        while True:
            try:
                op, arg = conn.recv()
            except (EOFError, OSError):
                return  # the worker has gone
            try:
                reply: tuple[bool, object] = (True, self.answer(op, arg))
            except Exception as exc:  # the worker re-raises it
                reply = (False, exc)
            try:
                conn.send(reply)
            except (pickle.PicklingError, TypeError, AttributeError):
                conn.send((False, RuntimeError(f"{type(reply[1]).__name__}: {reply[1]}")))
            except (BrokenPipeError, OSError):
                return
