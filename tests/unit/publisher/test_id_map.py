"""The id map (publisher/id_map.py): keys, the dynamic and hashed modes, entries, `apply`
checked and atomic on every refusal, copies and in-place loads."""

from __future__ import annotations

import hashlib
import pickle
import queue
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from publisher.id_map import (
    UNKNOWN_ROW,
    IdCapture,
    IdMap,
    IdMapError,
    canonical_key,
    hashed_rows,
)
from schemas.errors import BadDataError
from schemas.id_map_blob import MAX_KEY_BYTES, IdEntries


def state(m: IdMap) -> tuple[object, ...]:
    """Everything observable about a map, to check that a refused call changed nothing."""
    e = m.entries()
    held = {k: m.row_of(k) for k in e.keys if k}
    return (len(m), e.keys, e.assigned.tolist(), e.counts.tolist(), e.last_seen.tolist(), held)


def filled(rows: int = 8) -> IdMap:
    m = IdMap(rows)
    for row, key in ((1, "a"), (2, "b"), (5, "c")):
        m.assign(key, row)
        m.counts[row] = row * 10
        m.last_seen[row] = 1.7e9 + row
    return m


def test_canonical_keys() -> None:
    assert canonical_key(42) == "42" == canonical_key("42")
    assert canonical_key(-7) == "-7" and canonical_key("ключ") == "ключ"
    assert canonical_key("é" * (MAX_KEY_BYTES // 2)) == "é" * 128
    for bad in (True, 1.5, None, [1], b"x", ""):
        with pytest.raises(IdMapError):
            canonical_key(bad)
    with pytest.raises(IdMapError, match="at most 256 bytes"):
        canonical_key("é" * 129)
    with pytest.raises(IdMapError, match="UTF-8"):
        canonical_key("\ud800")
    assert issubclass(IdMapError, BadDataError)


def test_hashed_rows_are_blake2b_64_little_endian_mod_rows() -> None:
    keys = ["u1", "ключ", "42"]
    expected = [
        int.from_bytes(hashlib.blake2b(k.encode(), digest_size=8).digest(), "little") % 1000
        for k in keys
    ]
    assert hashed_rows(keys, 1000).tolist() == expected
    assert hashed_rows(["u1"], 1000).dtype == np.int64 and hashed_rows([], 10).shape == (0,)
    # Pinned: trainer and servers on other machines and Python versions must agree.
    assert hashed_rows(["u1", "item-9"], 2**31).tolist() == PINNED_HASHED_ROWS


PINNED_HASHED_ROWS = [1749916050, 2132086096]


def test_a_dynamic_map_assigns_looks_up_and_releases() -> None:
    m = IdMap(6)
    assert (len(m), m.capacity, m.free_rows().tolist()) == (0, 5, [1, 2, 3, 4, 5])
    m.assign("u1", 3)
    m.assign("u2", 1)
    m.counts[3] = 4
    assert m.lookup(["u1", "nope", "u2"]).tolist() == [3, UNKNOWN_ROW, 1]
    assert (m.row_of("u1"), m.row_of("nope"), m.key_of(3), m.key_of(2)) == (3, None, "u1", None)
    assert m.free_rows().tolist() == [2, 4, 5] and len(m) == 2
    assert m.release(3) == "u1" and m.counts[3] == 0
    assert m.release(3) is None and m.lookup(["u1"]).tolist() == [UNKNOWN_ROW]
    m.assign("u3", 3)  # a released row is reused
    assert m.row_of("u3") == 3 and m.counts[3] == 0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m: m.assign("z", UNKNOWN_ROW), "outside 1..7"),
        (lambda m: m.assign("z", 8), "outside 1..7"),
        (lambda m: m.assign("z", -1), "outside 1..7"),
        (lambda m: m.assign("z", 2), "held by another id"),
        (lambda m: m.assign("a", 3), "already holds row 1"),
        (lambda m: m.release(-1), "outside 0..7"),
        (lambda m: m.release(8), "outside 0..7"),
        (lambda m: m.key_of(-1), "outside 0..7"),
    ],
)
def test_refused_calls_change_nothing(call: Callable[[IdMap], object], message: str) -> None:
    m = filled()
    before = state(m)
    with pytest.raises(IdMapError, match=message):
        call(m)
    assert state(m) == before


def test_a_hashed_map_holds_counts_only() -> None:
    m = IdMap(1, hashed=True)  # one row is a valid hashed table
    h = IdMap(50, hashed=True)
    assert (len(h), h.capacity, h.free_rows().tolist()) == (0, 0, [])
    assert h.lookup(["u1", "u2"]).tolist() == hashed_rows(["u1", "u2"], 50).tolist()
    assert h.row_of("u1") == int(hashed_rows(["u1"], 50)[0]) and h.key_of(3) is None
    with pytest.raises(IdMapError, match="assigns no rows"):
        h.assign("u1", 3)
    assert m.rows == 1
    with pytest.raises(IdMapError, match="at least 2 rows"):
        IdMap(1)


def test_entries_are_copies_of_the_rows_state() -> None:
    m = filled()
    e = m.entries(np.array([5, 0, 2], dtype=np.int64))
    assert e.keys == ("c", "", "b") and e.assigned.tolist() == [True, False, True]
    assert e.counts.tolist() == [50, 0, 20] and e.last_seen.tolist() == [1.7e9 + 5, 0.0, 1.7e9 + 2]
    m.counts[5] = 999
    m.release(2)
    assert e.counts.tolist() == [50, 0, 20] and e.keys == ("c", "", "b")
    everything = m.entries()
    assert everything.n == 8 and everything.keys == ("", "a", "", "", "", "c", "", "")
    m.counts[1] = -5
    assert everything.counts[1] == 10


def test_apply_rebuilds_a_map_from_its_entries() -> None:
    m = filled()
    fresh = IdMap(8)
    fresh.apply(np.arange(8), m.entries())
    assert state(fresh) == state(m)
    # Moving an id between rows in one apply, and freeing a row, are fine.
    moved = IdEntries(np.array([False, True]), np.array([0, 1]), np.array([0.0, 2.0]), ("", "a"))
    fresh.apply(np.array([1, 4]), moved)
    assert fresh.row_of("a") == 4 and fresh.key_of(1) is None and fresh.counts[4] == 1
    assert fresh.free_rows().tolist() == [1, 3, 6, 7]


def entries_of(*keys: str, counts: list[int] | None = None) -> IdEntries:
    n = len(keys)
    return IdEntries(
        np.array([bool(k) for k in keys]),
        np.array(counts if counts is not None else [0] * n, dtype=np.int64),
        np.zeros(n),
        keys,
    )


@pytest.mark.parametrize(
    ("rows", "entries", "message"),
    [
        ([3, 8], entries_of("x", "y"), "within"),
        ([-1, 3], entries_of("x", "y"), "within"),
        ([3, 3], entries_of("x", "y"), "unique"),
        ([3, 4, 6], entries_of("x", "y"), "3 rows but 2"),
        ([0], entries_of("x"), "row 0 cannot be assigned"),
        ([3, 4], entries_of("x", "x"), "assigned to rows 3 and 4"),
        ([3], entries_of("a"), "already holds row 1"),  # row 1 is not among the changed rows
        ([3, 4], entries_of("x", "y", counts=[0, -1]), "counts must be >= 0"),
        ([3], IdEntries(np.array([False]), np.zeros(1, np.int64), np.zeros(1), ("x",)), "names"),
        ([3], IdEntries(np.array([True]), np.zeros(1, np.int64), np.zeros(1), ("",)), "empty"),
        (
            [3],
            IdEntries(np.array([True]), np.zeros(1, np.int64), np.array([np.nan]), ("x",)),
            "finite",
        ),
        ([3], IdEntries(np.array([True]), np.zeros(1, np.int64), np.zeros(1), (7,)), "not a key"),  # type: ignore[arg-type]
        ([3], IdEntries(np.array([True]), np.zeros(1, np.int64), np.zeros(1), ("é" * 200,)), "256"),
        # Arrays of other lengths than the rows: counts of length 1 would broadcast silently.
        (
            [3, 4],
            IdEntries(np.array([True, True]), np.zeros(1, np.int64), np.zeros(2), ("x", "y")),
            "2 rows",
        ),
        (
            [3, 4],
            IdEntries(np.array([True, True]), np.zeros(2, np.int64), np.zeros(3), ("x", "y")),
            "2 rows",
        ),
        (
            [3, 4],
            IdEntries(np.array([True, True]), np.zeros(2, np.int64), np.zeros(2), ("x",)),
            "2 rows",
        ),
    ],
)
@pytest.mark.parametrize("method", ["apply", "check"])
def test_apply_is_checked_and_atomic(
    rows: list[int], entries: IdEntries, message: str, method: str
) -> None:
    # `check` refuses what `apply` refuses, and neither changes the map.
    m = filled()
    before = state(m)
    with pytest.raises(IdMapError, match=message):
        getattr(m, method)(np.array(rows, dtype=np.int64), entries)
    assert state(m) == before


def test_a_checked_write_is_what_apply_does_on_the_map_or_an_equal_copy() -> None:
    m = filled()
    before = state(m)
    moved = IdEntries(np.array([False, True]), np.array([0, 1]), np.array([0.0, 2.0]), ("", "a"))
    checked = m.check(np.array([1, 4]), moved)
    assert state(m) == before  # check only reads
    twin = m.copy()
    m.write(checked)
    twin.write(checked)  # a server's second copy of the model replays the same write
    applied = filled()
    applied.apply(np.array([1, 4]), moved)
    assert state(m) == state(twin) == state(applied)
    assert m.row_of("a") == 4 and m.key_of(1) is None


def test_a_hashed_map_applies_counts_but_no_keys() -> None:
    h = IdMap(10, hashed=True)
    h.apply(np.array([2, 7]), entries_of("", "", counts=[3, 4]))
    assert h.counts[[2, 7]].tolist() == [3, 4] and len(h) == 0
    with pytest.raises(IdMapError, match="cannot be assigned"):
        h.apply(np.array([1]), entries_of("u1"))
    assert h.counts[1] == 0


def test_copy_is_independent() -> None:
    m = filled()
    c = m.copy()
    assert state(c) == state(m)
    c.release(1)
    c.counts[5] = 0
    m.assign("d", 3)
    assert m.row_of("a") == 1 and m.counts[5] == 50 and c.row_of("d") is None


def test_load_from_replaces_the_state_in_place() -> None:
    target = IdMap(8)
    target.assign("old", 7)
    counts, last_seen = target.counts, target.last_seen
    source = filled()
    target.load_from(source)
    assert state(target) == state(source) and target.row_of("old") is None
    assert target.counts is counts and target.last_seen is last_seen  # references stay valid
    source.release(1)
    assert target.row_of("a") == 1  # a copy, not a view of the source
    before = state(target)
    for other in (IdMap(9), IdMap(8, hashed=True)):
        with pytest.raises(IdMapError, match="cannot be loaded"):
            target.load_from(other)
    assert state(target) == before


def test_nbytes_grows_with_the_ids_held() -> None:
    m = IdMap(100)
    empty = m.nbytes
    for row in range(1, 51):
        m.assign(f"user-{row}", row)
    assert m.nbytes == empty + 50 * 130 and empty >= 100 * (8 + 8 + 8 + 1)


def same_entries(a: IdEntries, b: IdEntries) -> bool:
    return (
        a.keys == b.keys
        and a.assigned.tolist() == b.assigned.tolist()
        and a.counts.tolist() == b.counts.tolist()
        and a.last_seen.tolist() == b.last_seen.tolist()
    )


def test_a_capture_resolves_to_the_entries_when_it_was_taken() -> None:
    m = filled(12)
    rows = np.array([1, 2, 4, 5, 9], dtype=np.int64)
    expected, expected_all = m.entries(rows), m.entries()
    some, everything = m.capture(rows), m.capture()
    # Every way keys change afterwards: eviction, admission into a freed row, apply, load_from.
    m.release(1)
    m.assign("a2", 1)
    m.assign("d", 4)
    m.counts[[2, 5]] += 7
    m.apply(np.array([5, 9]), entries_of("", "c", counts=[1, 1]))
    other = filled(12)
    other.assign("z", 11)
    m.load_from(other)
    m.release(2)
    assert same_entries(some.entries(), expected) and same_entries(
        everything.entries(), expected_all
    )
    assert some.entries() is some.entries()  # resolved once
    assert m._capture_logs == {}  # resolved captures stop the logging


def test_a_dropped_capture_stops_the_logging() -> None:
    m = filled()
    capture = m.capture(np.array([1], dtype=np.int64))
    assert len(m._capture_logs) == 1
    del capture
    assert m._capture_logs == {}
    m.release(1)  # nothing to log into


def test_a_capture_pickles_as_its_entries() -> None:
    m = filled()
    capture = m.capture(np.array([1, 3], dtype=np.int64))
    m.release(1)
    again = pickle.loads(pickle.dumps(capture, protocol=5))
    assert isinstance(again, IdEntries) and again.keys == ("a", "")


def test_captures_resolve_on_another_thread_while_the_map_changes() -> None:
    m = IdMap(400)
    rng = np.random.default_rng(0)
    taken: queue.Queue[tuple[IdCapture, IdEntries] | None] = queue.Queue()
    resolved: list[tuple[IdEntries, IdEntries]] = []

    def resolver() -> None:
        while (item := taken.get()) is not None:
            resolved.append((item[0].entries(), item[1]))

    thread = threading.Thread(target=resolver)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the two threads as finely as CPython can
    try:
        thread.start()
        serial = 0
        for step in range(300):
            # Evict and admit as a trainer would, as fast as possible.
            for row in rng.integers(1, 400, 20).tolist():
                m.release(row)
                m.assign(f"id-{serial}", row)
                m.counts[row] += 1
                serial += 1
            rows = np.unique(rng.integers(0, 400, 50)).astype(np.int64)
            chosen = rows if step % 5 else None
            taken.put((m.capture(chosen), m.entries(chosen)))
        taken.put(None)
        thread.join()
    finally:
        sys.setswitchinterval(switch)
    assert len(resolved) == 300
    assert all(same_entries(got, expected) for got, expected in resolved)
    assert m._capture_logs == {}


def test_state_round_trips_through_a_weights_only_torch_file(tmp_path: Path) -> None:
    dynamic = filled()
    hashed = IdMap(5, hashed=True)
    hashed.counts[:] = [3, 0, 1, 7, 2]
    hashed.last_seen[2] = 1.5e9
    path = tmp_path / "maps.pt"
    torch.save({"d": dynamic.state(), "h": hashed.state()}, path)
    loaded = torch.load(path, weights_only=True)
    for name, original in (("d", dynamic), ("h", hashed)):
        again = IdMap.from_state(loaded[name])
        assert (again.rows, again.hashed) == (original.rows, original.hashed)
        assert state(again) == state(original)
    assert loaded["d"]["keys"] == ["", "a", "b", "", "", "c", "", ""]
    assert loaded["d"]["counts"].dtype == torch.int64
    assert loaded["d"]["last_seen"].dtype == torch.float64
    # Copies: the state does not change with the map.
    dynamic.counts[1] = 99
    assert int(loaded["d"]["counts"][1]) == 10 and int(dynamic.state()["counts"][1]) == 99
    # numpy arrays are taken too.
    numpy_state = {**dynamic.state(), "counts": dynamic.counts.copy()}
    assert state(IdMap.from_state(numpy_state)) == state(dynamic)


def _hostile_states() -> list[Any]:
    good = filled().state()
    n = len(good["keys"])
    keys = good["keys"]
    ints, floats = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.float64)
    cases: list[tuple[str, object, str]] = [
        ("a field missing", {k: v for k, v in good.items() if k != "hashed"}, "entries"),
        ("a field more", {**good, "rows": n}, "entries"),
        ("not a mapping", ["keys"], "entries"),
        ("hashed not a bool", {**good, "hashed": 0}, "'hashed' is a bool"),
        ("keys not a list", {**good, "keys": "abc"}, "list of str"),
        ("a key not a str", {**good, "keys": [*keys[:-1], 7]}, "list of str"),
        ("counts too short", {**good, "counts": ints[:-1]}, r"per row \(8\)"),
        ("counts of floats", {**good, "counts": floats}, "integer per row"),
        ("counts 2-d", {**good, "counts": ints.reshape(n, 1)}, "shape"),
        ("counts a list", {**good, "counts": [0] * n}, "is a tensor"),
        ("last_seen of ints", {**good, "last_seen": ints}, "float per row"),
        ("last_seen bfloat16", {**good, "last_seen": floats.bfloat16()}, "dtype"),
        ("negative counts", {**good, "counts": ints - 1}, ">= 0"),
        ("last_seen nan", {**good, "last_seen": floats + float("nan")}, "finite"),
        ("a key twice", {**good, "keys": ["", "a", "a", *keys[3:]]}, "rows 1 and 2"),
        ("an id on row 0", {**good, "keys": ["z", *keys[1:]]}, "row 0 cannot"),
        ("a key too long", {**good, "keys": ["", "x" * 10_000, *keys[2:]]}, "bytes"),
        ("ids in a hashed map", {**good, "hashed": True}, "cannot be assigned"),
        ("one row", {**good, "keys": [""], "counts": ints[:1], "last_seen": floats[:1]}, "2 rows"),
    ]
    return [pytest.param(bad, match, id=case) for case, bad, match in cases]


@pytest.mark.parametrize(("bad", "match"), _hostile_states())
def test_a_hostile_state_is_an_id_map_error(bad: Any, match: str) -> None:
    with pytest.raises(IdMapError, match=match):
        IdMap.from_state(bad)
