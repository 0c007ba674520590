"""librdkafka's lines through `KafkaLog`: the first at once, then at most one every few
seconds with the count held back, and the count said once the lines stop."""

from __future__ import annotations

import logging
import re

import pytest

from trainer.streams.kafka_log import KafkaLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_outage_logs_a_line_every_few_seconds_and_counts_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    log = KafkaLog(logging.getLogger("test.kafka"), every_s=5.0, clock=clock)
    caplog.set_level(logging.INFO, logger="test.kafka")
    # 15 s of an outage at ~29 lines a second, as measured.
    for tick in range(15 * 29):
        clock.now = 100.0 + tick / 29
        log.log(logging.ERROR, "FAIL|rdkafka#consumer-1| Connect to ipv4#127.0.0.1:%d failed", 9)
        log.error("_TRANSPORT: all brokers down")
        log.tick()
    lines = [r.getMessage() for r in caplog.records]
    assert 3 <= len(lines) <= 4, lines  # one at once, then one per 5 s
    assert lines[0] == "FAIL|rdkafka#consumer-1| Connect to ipv4#127.0.0.1:9 failed"
    assert "more Kafka lines in the last 5 s)" in lines[1]
    held = sum(int(line.split("(and ")[1].split()[0]) for line in lines[1:])
    # the broker is back: the last lines held back are said once, and nothing after
    clock.now += 5.0
    log.tick()
    log.tick()
    last = caplog.records[-1].getMessage()
    assert re.fullmatch(r"Kafka: \d+ more Kafka lines in the last \d+ s", last), last
    held += int(last.split()[1])
    assert held + len(lines) == 2 * 15 * 29  # every line logged or counted
    assert caplog.records[-1].levelno == logging.ERROR  # the worst of those held back


def test_lines_below_the_level_are_dropped_not_counted(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = KafkaLog(logging.getLogger("test.kafka.quiet"), clock=clock)
    caplog.set_level(logging.WARNING, logger="test.kafka.quiet")
    log.log(logging.DEBUG, "debug line")
    log.tick()
    assert caplog.records == [] and log.held == 0
