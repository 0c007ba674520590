"""Resume exactness: an interrupted run resumed from an fp32 checkpoint ends bitwise equal to an
uninterrupted run, and the reader continues with no sample trained twice or skipped."""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from publisher.read.catalog import Catalog, NoVersionError
from publisher.read.restore import RestoreError
from publisher.store import FileStore
from publisher.tunables import Tunables
from schemas.tensor_blob import decode_tensors, encode_tensors
from trainer.checkpointer import CheckpointError, IncrementalCheckpointer
from trainer.online import build_dlrm, build_optimizers, train_online
from trainer.streams.base import Batch, DataError
from trainer.streams.synthetic import SyntheticConfig, SyntheticStream

BATCH = 128
INTERVAL = 1000  # not a multiple of the batch: checkpoints land on the next batch boundary
TOTAL = 8000


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        yield


def stream() -> SyntheticStream:
    return SyntheticStream(
        SyntheticConfig(cardinalities=(40, 900, 5000, 6, 2500), seed=11, chunk=500, drift=0.5)
    )


def trainer(seed: int, store: FileStore, policy: str) -> tuple[Any, list[Any], Any]:
    s = stream()
    model = build_dlrm(s.features, s.dense_names, seed=seed)
    optimizers = build_optimizers(model)
    ckpt = IncrementalCheckpointer(
        model,
        optimizers,
        store=store,
        model_name="resume",
        policy=policy,
        codec="fp32",
        interval_samples=INTERVAL,
    )
    return model, optimizers, ckpt


def state_of(model: torch.nn.Module, optimizers: list[Any]) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor, by a stable name."""
    out = {f"param.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, opt in enumerate(optimizers):
        for j, per in opt.state_dict()["state"].items():
            for name, value in per.items():
                out[f"opt{i}.{j}.{name}"] = torch.as_tensor(value).clone()
    return out


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        assert x.dtype == y.dtype and x.shape == y.shape, key
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), key


@pytest.mark.parametrize("policy", ["consecutive", "intermittent"])
def test_interrupted_and_resumed_run_equals_uninterrupted(tmp_path: Path, policy: str) -> None:
    # Uninterrupted reference.
    model, opts, ckpt = trainer(seed=0, store=FileStore(tmp_path / "a"), policy=policy)
    with ckpt:
        train_online(model, opts, stream(), batch_size=BATCH, stop=TOTAL, checkpointer=ckpt)
    reference = state_of(model, opts)

    # Interrupted: crash 3 checkpoints in, a few batches past the third boundary.
    store = FileStore(tmp_path / "b")
    seen: list[tuple[int, int]] = []

    def record(batch: Batch, _: object) -> None:
        seen.append((batch.offset, batch.end))

    model, opts, ckpt = trainer(seed=0, store=store, policy=policy)
    with ckpt:
        crash_at = 3 * INTERVAL + 5 * BATCH
        report = train_online(
            model,
            opts,
            stream(),
            batch_size=BATCH,
            stop=crash_at,
            checkpointer=ckpt,
            final_checkpoint=False,
            on_batch=record,
        )
    assert len(report.records) == 3
    committed = Catalog(store, "resume").latest()
    # (snapshots may have merged while the publisher was busy: fewer versions, same state)
    assert committed is not None and committed.manifest.kind in ("full", "delta")
    position = committed.manifest.position
    checkpoint_offset = int(position.reader["offset"])
    assert checkpoint_offset == report.records[-1].samples_seen == position.samples_seen
    assert checkpoint_offset % BATCH == 0 and INTERVAL * 3 <= checkpoint_offset < crash_at
    del model, opts  # the crashed process is gone

    # Resume into a model initialised differently: everything must come from the checkpoint.
    model, opts, ckpt = trainer(seed=99, store=store, policy=policy)
    with ckpt:
        pos = ckpt.resume()
        s = stream()
        start = s.resume_offset(pos.reader)
        assert start == checkpoint_offset and ckpt.samples_seen == checkpoint_offset
        resumed: list[tuple[int, int]] = []
        train_online(
            model,
            opts,
            s,
            batch_size=BATCH,
            start=start,
            stop=TOTAL,
            checkpointer=ckpt,
            on_batch=lambda b, _: resumed.append((b.offset, b.end)),
        )
        first_after_resume = ckpt.records[0]
    assert first_after_resume.kind == "full"  # a resumed writer starts a new baseline
    assert_bitwise_equal(state_of(model, opts), reference)

    # The samples that made it into the final model: each exactly once, none skipped.
    kept = [(a, b) for a, b in seen if b <= checkpoint_offset] + resumed
    covered = [i for a, b in kept for i in range(a, b)]
    assert covered == list(range(TOTAL))


def test_resume_of_a_given_version_and_errors(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    model, opts, ckpt = trainer(seed=0, store=store, policy="consecutive")
    with ckpt:
        with pytest.raises(NoVersionError):
            ckpt.resume()
        train_online(model, opts, stream(), batch_size=BATCH, stop=2500, checkpointer=ckpt)
    # Version 1 is the first snapshot, or the first ones folded together if publishing lagged.
    v1 = next(r for r in ckpt.records if r.version == 1)
    model, opts, ckpt = trainer(seed=5, store=store, policy="consecutive")
    with ckpt:
        pos = ckpt.resume(version=1)
        assert ckpt.last_restored_version == 1
        assert pos.reader["offset"] == pos.samples_seen == ckpt.samples_seen
        assert INTERVAL <= pos.samples_seen == v1.samples_seen < 2500
        other_data = SyntheticStream(SyntheticConfig(cardinalities=(40, 900), seed=1))
        with pytest.raises(DataError, match="fingerprint"):
            other_data.resume_offset(pos.reader)

    # A model with another architecture refuses the checkpoint.
    s = stream()
    other = build_dlrm(s.features, s.dense_names, seed=0, extra={"variant": 2})
    ckpt = IncrementalCheckpointer(
        other,
        build_optimizers(other),
        store=store,
        model_name="resume",
        codec="fp32",
        interval_samples=INTERVAL,
    )
    with ckpt, pytest.raises(CheckpointError, match="model_config"):
        ckpt.resume()


def test_resume_checks_the_memory_budget_before_allocating(tmp_path: Path) -> None:
    # The same budget rule as serving and `checknrun restore` (publisher/memory_budget.py): a
    # manifest declaring more state than the trainer's budget is refused before a blob is read.
    store = FileStore(tmp_path)
    model, opts, ckpt = trainer(seed=0, store=store, policy="consecutive")
    with ckpt:
        train_online(model, opts, stream(), batch_size=BATCH, stop=1500, checkpointer=ckpt)
    needed = Catalog(store, "resume").find().manifest.full_fp32_bytes
    s = stream()
    for budget, fits in ((needed - 1, False), (needed, True)):
        model = build_dlrm(s.features, s.dense_names, seed=7)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        ckpt = IncrementalCheckpointer(
            model,
            build_optimizers(model),
            store=store,
            model_name="resume",
            codec="fp32",
            interval_samples=INTERVAL,
            tunables=Tunables(memory_budget_bytes=budget),
        )
        with ckpt:
            if fits:
                ckpt.resume()
                continue
            with pytest.raises(RestoreError, match="over the memory budget"):
                ckpt.resume()
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def _forge_optimizer_meta(root: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Change the latest version's optimizer metadata; make its manifest agree (size, sha256)."""
    ref = Catalog(FileStore(root), "resume").find()
    doc = json.loads((root / ref.key).read_bytes())
    entry = doc["optimizer"]
    tensors, meta = decode_tensors((root / entry["key"]).read_bytes())
    change(meta)
    forged = encode_tensors(tensors, meta)
    (root / entry["key"]).write_bytes(forged)
    entry["size"], entry["sha256"] = len(forged), hashlib.sha256(forged).hexdigest()
    (root / ref.key).write_text(json.dumps(doc))


def _first_shape(meta: dict[str, Any], value: Any) -> None:
    shapes = meta["optimizers"][1]["shapes"]
    shapes[next(iter(shapes))] = value


FORGED_META: dict[str, Callable[[dict[str, Any]], None]] = {
    "optimizers not objects": lambda m: m.update(optimizers=["a", "b"]),
    "no param_groups": lambda m: m["optimizers"][1].pop("param_groups"),
    "shapes a list": lambda m: m["optimizers"][1].update(shapes=[1]),
    "shape of text": lambda m: _first_shape(m, ["x"]),
    "shape of another size": lambda m: _first_shape(m, [7, 7, 7]),
    "huge shape": lambda m: _first_shape(m, [2**70]),
    "row state of no table": lambda m: m.update(row_state={"nowhere": []}),
    "row state of no optimizer": lambda m: m["row_state"][next(iter(m["row_state"]))][
        0
    ].__setitem__(0, 9),
    "row state short": lambda m: m["row_state"][next(iter(m["row_state"]))][0].pop(),
    "row state too wide": lambda m: m["row_state"][next(iter(m["row_state"]))][0].__setitem__(
        3, [3, 5]
    ),
    "scalars not an object": lambda m: m["optimizers"][1].update(scalars=[1]),
}


@pytest.mark.parametrize("case", FORGED_META)
def test_forged_optimizer_metadata_is_a_checkpoint_error(tmp_path: Path, case: str) -> None:
    # The optimizer blob's metadata is store data like any other: a forged one (its manifest
    # entry made to agree) is refused as a CheckpointError, never an escaping KeyError or
    # ValueError, and `train --resume` reports it in one line.
    store = FileStore(tmp_path)
    model, opts, ckpt = trainer(seed=0, store=store, policy="consecutive")
    with ckpt:
        train_online(model, opts, stream(), batch_size=BATCH, stop=1500, checkpointer=ckpt)
    _forge_optimizer_meta(tmp_path, FORGED_META[case])
    model, opts, ckpt = trainer(seed=5, store=store, policy="consecutive")
    with ckpt, pytest.raises(CheckpointError, match="optimizer state"):
        ckpt.resume()


class _TwoTables(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Embedding(10, 4)
        self.b = torch.nn.Embedding(10, 4)


def test_per_row_state_of_tables_listed_in_another_order_is_refused(tmp_path: Path) -> None:
    # A torch optimizer loads state by parameter position: resumed into an optimizer that lists
    # the same-shaped tables the other way round, each table would get the other's state.
    from trainer.rowwise_adagrad import RowWiseAdagrad

    model = _TwoTables()
    opt = RowWiseAdagrad([model.a.weight, model.b.weight], lr=0.1)
    store = FileStore(tmp_path)
    with IncrementalCheckpointer(
        model, [opt], store=store, model_name="m", policy="full", codec="fp32"
    ) as ckpt:
        (model.a(torch.tensor([1])).sum() + 2 * model.b(torch.tensor([2])).sum()).backward()
        opt.step()
        ckpt.step(1)
        ckpt.checkpoint_now()
    fresh = _TwoTables()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    swapped = RowWiseAdagrad([fresh.b.weight, fresh.a.weight], lr=0.1)
    refused = pytest.raises(CheckpointError, match=r"in the version's order: \['a', 'b'\]")
    with (
        IncrementalCheckpointer(
            fresh, [swapped], store=store, model_name="m", policy="full", codec="fp32"
        ) as resumed,
        refused,
    ):
        resumed.resume()
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    assert all(float(s["sum"].abs().sum()) == 0.0 for s in swapped.state.values())


class _Dense(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(5, 3)
        self.first = torch.nn.Linear(3, 4)
        self.second = torch.nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(self.table(ids)))


def _trained_dense(store: FileStore, optimizer: Callable[..., torch.optim.Optimizer]) -> None:
    model = _Dense()
    opt = optimizer(model.parameters(), lr=0.1)
    with IncrementalCheckpointer(
        model, [opt], store=store, model_name="m", policy="full", codec="fp32"
    ) as ckpt:
        model(torch.tensor([1, 2])).sum().backward()
        opt.step()
        ckpt.step(1)
        ckpt.checkpoint_now()


def _refused_untouched(
    store: FileStore, params: Callable[[_Dense], list[torch.nn.Parameter]], match: str
) -> None:
    fresh = _Dense()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    opt = torch.optim.Adam(params(fresh), lr=0.1)
    with (
        IncrementalCheckpointer(
            fresh, [opt], store=store, model_name="m", policy="full", codec="fp32"
        ) as resumed,
        pytest.raises(CheckpointError, match=match),
    ):
        resumed.resume()
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    assert not opt.state  # nothing loaded


def test_state_of_another_optimizer_class_is_refused_before_anything_is_loaded(
    tmp_path: Path,
) -> None:
    # torch would load SGD's state into Adam and fail at the next step, on a missing key.
    store = FileStore(tmp_path)
    _trained_dense(store, torch.optim.SGD)
    _refused_untouched(
        store, lambda m: list(m.parameters()), r"torch\.optim\.sgd\.SGD, this optimizer a"
    )


def test_dense_state_at_parameters_of_other_shapes_is_refused(tmp_path: Path) -> None:
    # The version's moments listed the parameters first then second; this optimizer lists them
    # the other way round, so each position holds another shape's moments.
    store = FileStore(tmp_path)
    _trained_dense(store, torch.optim.Adam)
    _refused_untouched(
        store,
        lambda m: [m.table.weight, *m.second.parameters(), *m.first.parameters()],
        r"parameter 1 is \(2, 4\) here, its 'exp_avg' is \(4, 3\)",
    )
