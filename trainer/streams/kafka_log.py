"""librdkafka's log lines and errors, through Python logging at most one line every few seconds.

A broker outage makes librdkafka report every failed connection attempt to every broker it knows
(`FAIL ... Connect to ipv4#... failed: Connection refused`), and the consumer loop every error it
returns: measured, ~29 lines a second on the trainer's stderr through a 15 s outage. The reader's
clients hand both to `KafkaLog` instead (`logger=` and `error_cb` in their config), which logs the
first line at once and then at most one every `KAFKA_LOG_EVERY_S`, each saying how many it held
back since the previous one; `tick`, called by the consume loop, says how many were held back
once the lines stop.

    log = KafkaLog(logging.getLogger(__name__))
    Consumer({..., "logger": log, "error_cb": log.error})
    log.warning("Kafka: %s", error)        # the consume loop's errors, under the same limit
    log.tick()                             # each turn of the loop: the count of those held back
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

#: at most one librdkafka line per this many seconds.
KAFKA_LOG_EVERY_S = 5.0


class KafkaLog:
    """A logger-like sink for librdkafka (`log(level, msg, *args)`, as confluent-kafka calls a
    `logger`) that passes at most one line per `every_s` seconds of `clock` to `log`."""

    def __init__(
        self,
        log: logging.Logger,
        every_s: float = KAFKA_LOG_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log_to = log
        self.every_s = every_s
        self.clock = clock
        #: lines held back since the last one logged.
        self.held = 0
        self._held_level = logging.WARNING
        self._last_at: float | None = None

    def log(self, level: int, msg: str, *args: Any) -> None:
        """One line: logged if none was in the last `every_s`, else counted."""
        if not self.log_to.isEnabledFor(level):
            return
        now, last = self.clock(), self._last_at
        if last is not None and now - last < self.every_s:
            self.held += 1
            self._held_level = max(self._held_level, level) if self.held > 1 else level
            return
        if self.held and last is not None:
            msg = f"{msg} (and {self.held} more Kafka lines in the last {now - last:.0f} s)"
            self.held = 0
        self._last_at = now
        self.log_to.log(level, msg, *args)

    def warning(self, msg: str, *args: Any) -> None:
        self.log(logging.WARNING, msg, *args)

    def error(self, error: object) -> None:
        """librdkafka's `error_cb`: a client-wide error (all brokers down, a failed
        connection), not one of a record."""
        self.log(logging.WARNING, "Kafka: %s", error)

    def tick(self) -> None:
        """Called often (each turn of the consume loop): once `every_s` passed since the last
        line logged, say how many were held back since, so that no count is lost when the lines
        stop (the broker is back)."""
        if not self.held:
            return
        now, last = self.clock(), self._last_at
        if last is not None and now - last < self.every_s:
            return
        self.log_to.log(
            self._held_level,
            "Kafka: %d more Kafka lines in the last %.0f s",
            self.held,
            now - (last if last is not None else now),
        )
        self.held = 0
        self._last_at = now
