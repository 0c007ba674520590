"""What `checknrun train` shows while it trains: a bar on a terminal, a line every
PROGRESS_EVERY_S seconds anywhere else, and in both that it is waiting when no event comes.

tqdm draws nothing when stderr is not a terminal (a log file, a container's output, `| tee`),
so a trainer under a supervisor showed nothing until it ended; one waiting for events showed
nothing at all (107 s in one run). Without a terminal a line goes out every PROGRESS_EVERY_S
seconds, while waiting too:

    movielens: 1,204,224 samples (10,412 samples/s), 12 versions (last v12), AUC 0.7225 since
    start
    events: waiting for events (37 s); 51,200 samples (0 samples/s), 3 versions (last v9), AUC
    0.6810 since start, lag 0, bad events 2

The AUC is this process's progressive AUC: a resumed run counts it again from the resume (the
manifest keeps the AUC, not the score histograms it comes from, so it cannot be carried on).
Both modes are `train_online`'s `on_batch` and `on_wait` callbacks; the clock is a parameter,
so a test drives it without sleeping.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

from trainer.checkpointer import IncrementalCheckpointer
from trainer.options import human_bytes
from trainer.progressive_metrics import ProgressiveMetrics
from trainer.streams.base import Batch
from trainer.streams.kafka_events import KafkaEventStream

#: seconds between two progress lines without a terminal.
PROGRESS_EVERY_S = 10.0
#: the bar's figures (AUC, version, bytes) are refreshed every this many batches.
BAR_EVERY_BATCHES = 20
#: the bar's "waiting for events" is refreshed at most this often.
BAR_WAIT_REFRESH_S = 1.0


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class TrainingProgress:
    """Shows a run's progress on `bar` (a terminal) or, without one, as a line every `every_s`
    seconds of `clock` through `write`. `on_batch` after each batch trained, `on_wait` each
    time the stream waited for events in vain."""

    def __init__(
        self,
        name: str,
        ckpt: IncrementalCheckpointer,
        live: KafkaEventStream | None = None,
        *,
        bar: tqdm[Any] | None = None,
        every_s: float = PROGRESS_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        write: Callable[[str], None] = _to_stderr,
    ) -> None:
        self.name = name
        self.ckpt = ckpt
        self.live = live
        self.bar = bar
        self.every_s = every_s
        self.clock = clock
        self.write = write
        now = clock()
        #: samples trained by this process.
        self.samples = 0
        self.batches = 0
        self.metrics: ProgressiveMetrics | None = None
        self._line_at = now
        self._line_samples = 0
        self._batch_at = now  # when the last batch came, or the run started: a wait's start
        self._waiting = False
        self._bar_wait_at = -math.inf

    def on_batch(self, batch: Batch, metrics: ProgressiveMetrics) -> None:
        """Count a trained batch; a line is due when `every_s` passed since the last one."""
        now = self.clock()
        self.samples += batch.size
        self.batches += 1
        self.metrics = metrics
        self._batch_at = now
        was_waiting, self._waiting = self._waiting, False
        if self.bar is not None:
            self.bar.update(batch.size)
            if was_waiting or self.batches % BAR_EVERY_BATCHES == 0:
                self.bar.set_postfix(**self._bar_figures(), refresh=False)
        elif now - self._line_at >= self.every_s:
            self._write_line(now)

    def on_wait(self) -> None:
        """The stream waited for events and none came."""
        now = self.clock()
        self._waiting = True
        if self.bar is not None:
            if now - self._bar_wait_at >= BAR_WAIT_REFRESH_S:
                self._bar_wait_at = now
                self.bar.set_postfix_str(f"waiting for events ({now - self._batch_at:.0f} s)")
        elif now - self._line_at >= self.every_s:
            self._write_line(now)

    def line(self, now: float) -> str:
        """The progress line at `now` (of `clock`), rates over the time since the last line."""
        elapsed = now - self._line_at
        rate = (self.samples - self._line_samples) / elapsed if elapsed > 0 else 0.0
        head = f"{self.name}: "
        if self._waiting:
            head += f"waiting for events ({now - self._batch_at:.0f} s); "
        versions = self.ckpt.versions_committed
        last = self.ckpt.last_version
        parts = [
            f"{self.samples:,} samples ({rate:,.0f} samples/s)",
            f"{versions} version{'' if versions == 1 else 's'}"
            + (f" (last v{last})" if last is not None else ""),
        ]
        auc = self._auc()
        if auc is not None:
            parts.append(f"AUC {auc:.4f} since start")
        if self.live is not None:
            parts.append(f"lag {self.live.lag:,}")
            parts.append(f"bad events {self.live.bad.total:,}")
        return head + ", ".join(parts)

    def _write_line(self, now: float) -> None:
        self.write(self.line(now))
        self._line_at = now
        self._line_samples = self.samples

    def _auc(self) -> float | None:
        if self.metrics is None:
            return None
        auc = self.metrics.cumulative().get("auc_cumulative")
        return None if auc is None or math.isnan(auc) else auc

    def _bar_figures(self) -> dict[str, Any]:
        assert self.metrics is not None
        window = self.metrics.window() or self.metrics.cumulative()
        auc = window.get("auc", window.get("auc_cumulative", float("nan")))
        figures: dict[str, Any] = {
            "auc": f"{auc:.4f}",
            "version": self.ckpt.last_version or "-",
            "written": human_bytes(self.ckpt.bytes_written),
        }
        if self.live is not None:
            ids = sum(len(m) for m in self.live.id_maps.values())
            figures.update(lag=self.live.lag, bad=self.live.bad.total, ids=ids)
        return figures
