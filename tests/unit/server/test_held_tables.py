"""Quantized serving: tables held in FBGEMM's fused rowwise format against the float32 path.

The bound (publisher/read/held_tables.py): a held row decodes bitwise to what `decode_rows`
gives the blob's row, so a lookup of one id is exact; a bag's sum may differ from
`nn.EmbeddingBag`'s by (bag length - 1) * 2**-24 * sum |rows| elementwise; predictions of a
quantized server equal the float32 server's within float32 rounding of those sums through the
MLP (atol 1e-6 on scores).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.nn import functional

from bench.synthetic_run import SyntheticRun, random_examples, small_config
from publisher.codecs import CodecError, QuantizedRows, decode_rows, encode_rows
from publisher.dlrm import DLRMConfig, SparseFeature, build_served_model
from publisher.memory_budget import MemoryBudget
from publisher.read import Catalog, ConsistencyScheme
from publisher.read.copy_builders import ModuleBuilder
from publisher.read.held_tables import (
    SUM_ROUNDING,
    Float32Table,
    FusedTable,
    HeldFormat,
    held_format,
    looks_up,
    new_table,
)
from publisher.read.live_model import LiveModel
from publisher.read.restore import TableState, restore
from publisher.store import FileStore
from schemas.delta_blob import DeltaBlob
from tests.support import dlrm_live, dlrm_scores

SCHEMES: list[ConsistencyScheme] = ["double-buffer", "rwlock"]
INT_CODECS = ["int8", "int4", "int3", "int2", "int4-adaptive", "int8-adaptive"]

pytestmark = pytest.mark.skipif(
    not all(looks_up(f, 64) for f in ("int8", "int4", "int2")),
    reason="this torch lacks the quantized embedding-bag kernels (fp32 serving is then used)",
)


def _blob(
    codec: str, values: np.ndarray, ids: np.ndarray | None = None, rows: int = 0
) -> DeltaBlob:
    rows = rows or len(values)
    q = encode_rows(codec, values)
    return DeltaBlob(
        table="embeddings.t",
        codec=codec,
        dim=values.shape[1],
        table_rows=rows,
        row_ids=np.arange(rows, dtype=np.int64) if ids is None else ids,
        codes=q.codes,
        scale=q.scale,
        bias=q.bias,
        aux=np.zeros((len(values), 0), dtype=np.float32),
    )


def _decoded(blob: DeltaBlob) -> np.ndarray:
    return decode_rows(QuantizedRows(blob.codec, blob.dim, blob.codes, blob.scale, blob.bias))


def _rows(n: int, dim: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.1, (n, dim)).astype(np.float32)


@pytest.mark.parametrize(
    ("codec", "dim", "current", "expected"),
    [
        ("int4", 64, None, "int4"),
        ("int3", 64, None, "int4"),
        ("int2-adaptive", 64, None, "int2"),
        ("int8", 64, None, "int8"),
        ("fp16", 64, None, "fp32"),
        ("int2", 64, "int4", "int4"),  # coarser rows fit: no change
        ("int8", 64, "int4", "int8"),  # finer rows widen the table
        ("fp16", 64, "int8", "fp32"),
        ("int4", 64, "fp32", "fp32"),  # never narrowed
        ("int4", 7, None, "int8"),  # 4-bit needs an even dim: the next finer format
        ("int2", 6, None, "int4"),  # 2-bit needs a multiple of 4
    ],
)
def test_held_format_is_the_finest_so_far_that_the_kernels_look_up(
    codec: str, dim: int, current: HeldFormat | None, expected: HeldFormat
) -> None:
    assert held_format(codec, dim, current) == expected


@pytest.mark.parametrize("codec", INT_CODECS)
def test_a_held_table_decodes_to_the_blobs_rows_and_single_ids_look_up_exactly(
    codec: str,
) -> None:
    values = _rows(300, 64)
    blob = _blob(codec, values)
    table = new_table(300, 64, held_format(codec, 64))
    assert isinstance(table, FusedTable)
    assert table.write_blob(blob) is None  # every row: written in place
    expected = _decoded(blob)
    assert np.array_equal(table.values().numpy(), expected)
    ids = torch.randint(0, 300, (500,))
    single = table.module(ids, torch.arange(500))
    assert torch.equal(single, torch.from_numpy(expected)[ids])


@pytest.mark.parametrize("codec", ["int8", "int4", "int2"])
def test_bags_sum_within_the_stated_bound_of_embedding_bag(codec: str) -> None:
    blob = _blob(codec, _rows(1000, 64, seed=1))
    table = new_table(1000, 64, held_format(codec, 64))
    table.write_blob(blob)
    weights = torch.from_numpy(_decoded(blob))
    ids = torch.randint(0, 1000, (4000,))
    offsets = torch.arange(0, 4000, 40)  # bags of 40
    got = table.module(ids, offsets)
    want = functional.embedding_bag(ids, weights, offsets, mode="sum")
    magnitude = functional.embedding_bag(ids, weights.abs(), offsets, mode="sum")
    assert torch.all((got - want).abs() <= 39 * SUM_ROUNDING * magnitude)


def test_a_delta_copies_its_rows_into_place_and_the_record_replays_them() -> None:
    table = new_table(200, 16, "int8")
    table.write_blob(_blob("int8", _rows(200, 16)))
    ids = np.array([3, 50, 199], dtype=np.int64)
    delta = _blob("int4", _rows(3, 16, seed=2), ids, rows=200)  # coarser rows: repacked
    other = table.copy()
    written = table.write_blob(delta)
    assert written is not None
    expected = table.values().numpy().copy()
    assert np.array_equal(expected[ids], _decoded(delta))
    other.scatter(written)
    assert np.array_equal(other.values().numpy(), expected)


@pytest.mark.parametrize(("start", "to"), [("int2", "int4"), ("int4", "int8"), ("int4", "fp32")])
def test_a_table_widens_without_changing_a_value(start: HeldFormat, to: HeldFormat) -> None:
    table = new_table(100, 32, start)
    table.write_blob(_blob(start, _rows(100, 32)))
    wider = table.converted(to)
    assert wider.format == to
    assert isinstance(wider, FusedTable if to != "fp32" else Float32Table)
    assert np.array_equal(wider.values().numpy(), table.values().numpy())
    with pytest.raises(ValueError, match="narrowed"):
        wider.converted(start)


def test_a_finer_blob_of_no_rows_leaves_the_table_as_held() -> None:
    # --codec auto encodes a whole version int8 again; a table it did not touch has no rows.
    table = new_table(10, 8, "int4")
    table.write_blob(_blob("int4", _rows(10, 8)))
    before = table.values().numpy().copy()
    empty = _blob("int8", np.zeros((0, 8), dtype=np.float32), np.zeros(0, np.int64), rows=10)
    written = table.write_blob(empty)
    assert written is not None and len(written.ids) == 0
    assert table.format == "int4" and np.array_equal(table.values().numpy(), before)


def test_finer_rows_than_held_and_bad_scales_are_refused() -> None:
    table = new_table(10, 8, "int4")
    with pytest.raises(ValueError, match="do not fit"):
        table.write_blob(_blob("int8", _rows(10, 8)))
    bad = _blob("int4", _rows(10, 8))
    scale = bad.scale.copy()
    scale[4] = np.inf
    with pytest.raises(CodecError, match="scale of row 4"):
        table.write_blob(
            DeltaBlob(bad.table, bad.codec, 8, 10, bad.row_ids, bad.codes, scale, bad.bias, bad.aux)
        )


# --- served end to end: a quantized server against a float32 one ---------------------------------


def _scores(live: LiveModel, examples: list[dict[str, object]]) -> np.ndarray:
    with live.reader() as buffer:
        return dlrm_scores(buffer, examples)  # type: ignore[arg-type]


def _assert_same_values(
    quantized: LiveModel, plain: LiveModel, state_tables: Mapping[str, TableState]
) -> None:
    with quantized.reader() as q, plain.reader() as p:
        for name in p.tables:
            assert p.tables[name].format == "fp32"
            assert np.array_equal(q.values(name).numpy(), p.values(name).numpy()), name
            assert np.array_equal(q.values(name).numpy(), state_tables[name].weights), name


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_quantized_server_predicts_what_the_float32_server_does(
    tmp_path: Path, scheme: ConsistencyScheme
) -> None:
    store = FileStore(tmp_path / "store")
    run = SyntheticRun(store, "m", small_config(dim=16), codec="int4")
    run.train(2)
    run.publish("full")
    quantized = dlrm_live(store, "m", scheme)
    plain = dlrm_live(store, "m", scheme, quantized=False)
    for live in (quantized, plain):
        live.bootstrap()
    examples = random_examples(run.config, 64, seed=3)
    catalog = Catalog(store, "m")
    for _ in range(3):
        run.train(2)
        ref = catalog.find(run.publish().ref.version)
        for live in (quantized, plain):
            live.advance(ref)
        _assert_same_values(quantized, plain, restore(store, "m", ref.version).tables)
        np.testing.assert_allclose(_scores(quantized, examples), _scores(plain, examples), 0, 1e-6)
    with quantized.reader() as buffer:
        assert set(buffer.formats.values()) == {"int4"}
    assert quantized.nbytes() < plain.nbytes() / 2
    if scheme == "double-buffer":  # the hidden copy was brought level by replaying the rows
        standby = quantized.sink.slot._standby  # type: ignore[attr-defined]
        live_buffer = quantized.sink.slot.current()
        assert standby is not None and live_buffer is not None
        assert standby.digest() == live_buffer.digest()


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("plan_at_once", [False, True])
def test_a_finer_codec_widens_the_table_for_the_rest_of_the_lineage(
    tmp_path: Path, scheme: ConsistencyScheme, plan_at_once: bool
) -> None:
    store = FileStore(tmp_path / "store")
    run = SyntheticRun(store, "m", small_config(dim=16), codec="int4")
    run.publish("full")
    quantized = dlrm_live(store, "m", scheme)
    plain = dlrm_live(store, "m", scheme, quantized=False)
    for live in (quantized, plain):
        live.bootstrap()
    catalog = Catalog(store, "m")
    expected: list[HeldFormat] = ["int4", "int8", "int8", "fp32", "fp32"]
    versions = []
    for codec in ["int2", "int8", "int4", "fp16", "int4"]:
        run.codec = codec
        run.train(2)
        versions.append(run.publish().ref.version)
        if plan_at_once:
            continue  # one plan of every delta below (a server catching up)
        for live in (quantized, plain):
            live.advance(catalog.find(versions[-1]))
        with quantized.reader() as buffer:
            assert set(buffer.formats.values()) == {expected[len(versions) - 1]}
    if plan_at_once:
        for live in (quantized, plain):
            assert live.advance(catalog.find(versions[-1])) == versions
    with quantized.reader() as buffer:
        assert set(buffer.formats.values()) == {"fp32"}
    _assert_same_values(quantized, plain, restore(store, "m", versions[-1]).tables)
    examples = random_examples(run.config, 32, seed=4)
    np.testing.assert_allclose(_scores(quantized, examples), _scores(plain, examples), 0, 1e-6)
    if scheme == "double-buffer":
        standby = quantized.sink.slot._standby  # type: ignore[attr-defined]
        assert standby is not None and standby.formats == quantized.sink.slot.current().formats  # type: ignore[union-attr]
        assert standby.digest() == quantized.sink.slot.current().digest()  # type: ignore[union-attr]


def test_a_buffer_starts_each_table_in_its_full_versions_format(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    run = SyntheticRun(store, "m", small_config(dim=16), codec="int2")
    manifest = run.publish("full").manifest
    budget = MemoryBudget(2**30)
    builder = ModuleBuilder(factory=build_served_model)
    buffer = builder.new_copy(manifest, budget, 2, quantized=True)
    assert set(buffer.formats.values()) == {"int2"}
    assert set(builder.new_copy(manifest, budget, 2, quantized=False).formats.values()) == {"fp32"}


def _peak_rss_growth(action: Callable[[], object]) -> int:
    """Bytes the peak resident memory rose above the resident memory while `action` ran."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS

    def status(field: str) -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if field in x)
        return int(line.split()[1]) * 1024

    before = status("VmRSS:")
    kept = action()
    growth = status("VmHWM:") - before
    del kept
    return growth


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_a_buffer_of_quantized_tables_never_writes_their_float32_tables() -> None:
    # 64 MiB of float32 rows: drawing them (as a trained model's start does) makes every page
    # resident, only for the int4 table (9 MiB, written by the full version) to replace them.
    config = DLRMConfig(
        sparse=(SparseFeature("big", 1 << 18), SparseFeature("small", 10)),
        dense=("d0",),
        embedding_dim=64,
        bottom_mlp=(8,),
        top_mlp=(8,),
    )
    formats: dict[str, HeldFormat] = {"embeddings.big": "int4", "embeddings.small": "int4"}
    # The two fields of a full version's manifest the builder reads.
    tables = [
        SimpleNamespace(name=f"embeddings.{f.name}", rows=f.rows, dim=64, has_id_map=False)
        for f in config.sparse
    ]
    manifest = SimpleNamespace(
        model_config_=config.to_json(), tables=tables, kind="full", version=1
    )
    builder = ModuleBuilder(factory=build_served_model)
    assert _peak_rss_growth(lambda: builder.build(manifest, formats)) < 16 * 2**20  # type: ignore[arg-type]
