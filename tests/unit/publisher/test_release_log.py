"""RELEASED, its records and evaluations in a store (docs/FORMAT.md 9.1-9.3): a move writes its
record then swaps the pointer, a stale mover loses and leaves only an orphan record, records
walk back from RELEASED, the last good version skips rolled-back ones, an evaluation is written
once, and hostile documents are refused with their typed error."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from publisher.cli import main
from publisher.read.catalog import Catalog
from publisher.release import ReleaseConflictError, ReleaseLog
from publisher.store import FileStore, ObjectTooLargeError
from schemas.release import Evaluation, Released, ReleaseFormatError
from schemas.store_keys import released_key, releases_prefix
from tests.example_training import ExampleTrainer


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Five committed versions of the two-tower example."""
    path = tmp_path_factory.mktemp("store")
    trainer = ExampleTrainer("two_tower")
    with trainer.checkpointer(f"file://{path}", interval_samples=256, codec="int4") as ckpt:
        trainer.train(20, ckpt)
    return path


def _fresh(store: Path, tmp_path: Path) -> tuple[ReleaseLog, Catalog]:
    """A copy of the versions without any release state."""

    copy = tmp_path / "copy"
    shutil.copytree(
        store, copy, ignore=shutil.ignore_patterns("RELEASED", "releases", "evaluations")
    )
    fs = FileStore(copy)
    return ReleaseLog(fs, "two_tower"), Catalog(fs, "two_tower")


def test_moves_chain_their_records_and_the_last_good_skips_rollbacks(
    store: Path, tmp_path: Path
) -> None:
    log, catalog = _fresh(store, tmp_path)
    assert log.released() is None and log.last_good() is None
    first = log.move(catalog.find(2), action="release", by="gate", reason="passed")
    assert (first.version, first.pointer.sequence, first.record.previous) == (2, 1, None)
    log.move(catalog.find(4), action="release", by="person", reason="by hand")
    assert log.last_good() == 2
    log.move(catalog.find(2), action="rollback", by="gate", reason="v4 worse than v2")
    log.move(catalog.find(5), action="release", by="gate", reason="passed")
    # v4 was rolled back: a rollback from v5 returns to v2
    assert log.last_good() == 2
    records = list(log.records())
    assert [(r.sequence, r.version, r.action) for r in records] == [
        (4, 5, "release"),
        (3, 2, "rollback"),
        (2, 4, "release"),
        (1, 2, "release"),
    ]
    assert records[1].previous_version == 4 and records[1].by == "gate"
    released = log.released_version()
    assert released is not None and released.key == catalog.find(5).key


def test_a_stale_mover_loses_and_leaves_an_orphan_record(store: Path, tmp_path: Path) -> None:
    log, catalog = _fresh(store, tmp_path)
    log.move(catalog.find(1), action="release", by="gate", reason="first")
    seen = log.released()
    other = ReleaseLog(log.store, "two_tower")
    other.move(catalog.find(3), action="release", by="person", reason="by hand", expected=seen)
    with pytest.raises(ReleaseConflictError, match="moved while"):
        log.move(catalog.find(2), action="release", by="gate", reason="late", expected=seen)
    current = log.released()
    assert current is not None and current.version == 3 and current.pointer.sequence == 2
    keys = [info.key for info in log.store.list(releases_prefix("two_tower"))]
    assert len(keys) == 3  # the loser's record is there, and nothing reaches it
    assert [r.version for r in log.records()] == [3, 1]


def test_an_evaluation_is_written_once(store: Path, tmp_path: Path) -> None:
    from publisher.release.rules import GateConfig, judge
    from schemas.release import Window

    log, catalog = _fresh(store, tmp_path)
    ref = catalog.find(3)
    labels = [0.0, 1.0] * 300
    scores = [0.3, 0.7] * 300

    def evaluation(reason_scores: list[float]) -> Evaluation:
        return judge(
            model="two_tower",
            version=3,
            manifest=ref.key,
            window=Window(after_samples=0, examples=600, positives=300),
            labels=labels,
            candidate=reason_scores,
            released=None,
            reference=None,
            probation=None,
            config=GateConfig(),
        ).evaluation

    first = evaluation(scores)
    assert log.write_evaluation(first) is True
    assert log.write_evaluation(evaluation([0.5] * 600)) is False
    assert log.evaluation(3) == first and log.evaluation(4) is None
    assert log.evaluated_versions() == [3]


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"not json", "JSON"),
        (b'{"schema_version": 1}', "invalid RELEASED"),
        (
            b'{"schema_version":1,"model":"two_tower","version":1,"manifest":"other/manifests/'
            b'000000000001-x.json","sequence":1,"record":"two_tower/releases/000000000001-x.json"}',
            "not a safe key",
        ),
        (
            b'{"schema_version":1,"model":"two_tower","version":1,"manifest":"two_tower/'
            b'manifests/000000000001-x.json","sequence":1,"record":"two_tower/HEAD"}',
            "not a release record key",
        ),
    ],
)
def test_hostile_released_is_refused(store: Path, tmp_path: Path, data: bytes, match: str) -> None:
    log, _ = _fresh(store, tmp_path)
    log.store.put(released_key("two_tower"), data)
    with pytest.raises(ReleaseFormatError, match=match):
        log.released()


def test_an_oversized_released_is_not_read_past_the_cap(store: Path, tmp_path: Path) -> None:
    log, _ = _fresh(store, tmp_path)
    log.store.put(released_key("two_tower"), b"{" + b" " * 70_000 + b"}")
    with pytest.raises(ObjectTooLargeError, match="65536"):
        log.released()


def test_released_naming_another_record_is_refused(store: Path, tmp_path: Path) -> None:
    log, catalog = _fresh(store, tmp_path)
    moved = log.move(catalog.find(1), action="release", by="gate", reason="first")
    lying = Released(
        model="two_tower",
        version=2,
        manifest=catalog.find(2).key,
        sequence=1,
        record=moved.pointer.record,
    )
    log.store.put(released_key("two_tower"), lying.to_json())
    with pytest.raises(ReleaseFormatError, match="its record"):
        log.released()


def test_a_person_releases_and_rolls_back_from_the_command_line(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log, _ = _fresh(store, tmp_path)
    url = f"file://{tmp_path / 'copy'}"
    bus = tmp_path / "bus.log"
    common = ["--store", url, "--model", "two_tower"]
    assert main(["ls", *common]) == 0
    assert " release " not in capsys.readouterr().out  # no gate: no release column
    assert main(["release", "2", *common, "--reason", "checked by hand"]) == 0
    assert "RELEASED is v2 (was none): checked by hand" in capsys.readouterr().out
    assert main(["release", "4", *common, "--bus", f"file://{bus}", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["released"], doc["previous"], doc["sequence"]) == (4, 2, 2)
    announced = [json.loads(line) for line in bus.read_text().splitlines()]
    assert announced[-1]["track"] == "released" and announced[-1]["version"] == 4
    assert main(["rollback", *common]) == 0  # to the last good one: v2
    assert "RELEASED is v2 (was v4): rolled back by hand" in capsys.readouterr().out
    assert main(["ls", *common, "--json"]) == 0
    rows = {r["version"]: r["release"] for r in json.loads(capsys.readouterr().out)["versions"]}
    assert rows[2]["status"] == "released" and rows[4]["status"] == "rolled_back"
    assert rows[5]["status"] == "pending" and rows[4]["by"] == "person"
    assert main(["ls", *common]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\s+4 .* rolled_back .*rolled back by hand$", out, re.M), out
    assert main(["inspect", *common, "--version", "2"]) == 0
    assert "release: released by the person: rolled back by hand" in capsys.readouterr().out
    log.store.put("two_tower/evaluations/000000000005.json", b"{broken")
    assert main(["ls", *common]) == 0
    assert re.search(
        r"^\s+5 .* unreadable .*unreadable evaluation: ", capsys.readouterr().out, re.M
    )
    assert main(["release", "9", *common]) == 1  # not committed
    assert "no committed version 9" in capsys.readouterr().err
    assert log.released() is not None
