"""A user's own models kept live by the public read side: a `Subscriber` in this process
follows versions that `IncrementalCheckpointer` publishes while it holds the writer's lease, and
at every version its model scores what the version's restore scores (fp32 bit for bit; int4
within a bag sum's float32 rounding, the only difference held tables allow).

Versions are published int4, fp32 and `codec="auto"` (each version's codec from its measured
served loss). The models are examples/two_tower.py (nn.Embedding / nn.EmbeddingBag, raw
string ids through id maps) and examples/deepfm.py (a TorchRec EmbeddingBagCollection fed a
KeyedJaggedTensor).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from examples import deepfm
from publisher.read import (
    ConsistencyScheme,
    ModuleSink,
    Subscriber,
    SubscriberObserver,
    SubscriberOptions,
    TensorSink,
    VersionSink,
    restore,
)
from publisher.store import FileStore
from publisher.write.version_writer import LeaseHeldError
from tests.user_model_runs import RUNS, UserRun
from trainer.checkpointer import IncrementalCheckpointer

pytest.importorskip("torchrec")

#: int4 rows decode exactly; a bag's sum may reorder float32 additions (held_tables.py).
INT4_ATOL = 1e-5
FAST = SubscriberOptions(poll_timeout_s=0.05, poll_head_after_s=0.05, retry_initial_s=0.05)


@pytest.fixture(params=sorted(RUNS))
def model(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def make_run(tmp_path: Path, model: str, codec: str) -> UserRun:
    return RUNS[model](f"file://{tmp_path / 'store'}", model, codec=codec)


def served_scores(
    sink: VersionSink, run: UserRun, examples: Sequence[Mapping[str, Any]]
) -> tuple[int, np.ndarray]:
    """(version, scores) of `examples` under one reader: raw ids mapped with that version's id
    maps, the request adapter's inputs, the served module's forward."""
    with sink.reader() as copy:
        assert copy.module is not None and copy.version is not None
        adapter = run.adapter(copy.model_config)
        mapped = [dict(e) for e in examples]
        for field, table in dict(getattr(adapter, "id_features", {})).items():
            rows = copy.id_maps[table].lookup([str(e[field]) for e in examples])
            for example, row in zip(mapped, rows.tolist(), strict=True):
                example[field] = row
        with torch.inference_mode():
            out = copy.module(*adapter.inputs(mapped))
        return copy.version, np.asarray(adapter.scores(out).numpy())


@pytest.mark.parametrize("codec", ["fp32", "int4", "auto"])
def test_a_subscriber_serves_every_version_as_its_restore_scores(
    tmp_path: Path, model: str, codec: str
) -> None:
    run = make_run(tmp_path, model, codec)
    sink = ModuleSink(run.build)
    sub = Subscriber(f"file://{tmp_path / 'store'}", model, sink, options=FAST)
    try:
        # The trainer holds the writer's lease all along; the subscriber takes none.
        with pytest.raises(LeaseHeldError):
            IncrementalCheckpointer(
                run.build(run.checkpointer.model_config),
                [],
                store=FileStore(tmp_path / "store"),
                model_name=model,
                policy="full",
            )
        examples = run.requests(32)
        versions = []
        for _ in range(4):
            run.train(7)
            versions.append(run.checkpoint())
            applied = sub.run(max_versions=1, timeout=10)
            assert applied and applied[-1] == versions[-1]
            version, served = served_scores(sink, run, examples)
            assert version == versions[-1]
            restored = run.restored_scores(version, examples)
            if codec == "fp32":
                assert served.tobytes() == restored.tobytes()
            else:
                np.testing.assert_allclose(served, restored, rtol=0, atol=INT4_ATOL)
        assert versions == list(range(1, 5))
        with sink.reader() as copy:
            held = set(copy.formats.values())
        # int4 needs an even dim: DeepFM's dim-1 first-order table is held int8.
        if codec == "fp32":
            assert held == {"fp32"}
        elif codec == "int4":
            assert "int4" in held and held <= {"int4", "int8"}
        else:  # each version's codec chosen from its measured served loss
            assert held <= {"int4", "int8", "fp32"}
            manifests = [
                restore(FileStore(tmp_path / "store"), model, v).manifest for v in versions
            ]
            assert all(m.served_loss is not None for m in manifests)
    finally:
        sub.close()
        run.close()


@pytest.mark.parametrize("scheme", ["double-buffer", "rwlock"])
def test_a_background_subscriber_keeps_up_while_the_trainer_publishes(
    tmp_path: Path, scheme: ConsistencyScheme
) -> None:
    run = make_run(tmp_path, "deepfm", "int4")
    sink = ModuleSink(run.build, scheme=scheme)
    examples = run.requests(16)
    with Subscriber(f"file://{tmp_path / 'store'}", "deepfm", sink, options=FAST) as sub:
        sub.start()
        try:
            for _ in range(3):
                run.train(7)
                version = run.checkpoint()
                assert sub.wait_for_version(version, timeout=20) == version
                served_version, served = served_scores(sink, run, examples)
                assert served_version == version
                np.testing.assert_allclose(
                    served, run.restored_scores(version, examples), rtol=0, atol=INT4_ATOL
                )
        finally:
            run.close()


@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_a_tensor_sink_holds_the_restore_of_every_version(
    tmp_path: Path, model: str, codec: str
) -> None:
    run = make_run(tmp_path, model, codec)
    sink = TensorSink()
    sub = Subscriber(f"file://{tmp_path / 'store'}", model, sink, options=FAST)
    try:
        for _ in range(3):
            run.train(7)
            version = run.checkpoint()
            sub.run(max_versions=1, timeout=10)
            state = restore(FileStore(tmp_path / "store"), model, version)
            with sink.reader() as copy:
                assert copy.version == version and copy.module is None
                for name, table in state.tables.items():
                    assert copy.values(name).numpy().tobytes() == table.weights.tobytes(), name
                assert set(copy.dense) == set(state.dense)
                for name, value in state.dense.items():
                    assert copy.dense[name].numpy().tobytes() == value.tobytes(), name
                assert set(copy.id_maps) == set(state.id_maps)
                for name, id_map in state.id_maps.items():
                    assert copy.id_maps[name].entries().keys == id_map.entries().keys
    finally:
        sub.close()
        run.close()


def test_a_template_module_serves_versions_of_its_tables_and_refuses_others(
    tmp_path: Path,
) -> None:
    url = f"file://{tmp_path / 'store'}"
    run = make_run(tmp_path, "two_tower", "int4")
    template = run.build(run.checkpointer.model_config)
    before = {k: v.clone() for k, v in template.state_dict().items()}
    sink = ModuleSink(template)
    with Subscriber(url, "two_tower", sink, options=FAST) as sub:
        run.train(7)
        v1 = run.checkpoint()
        assert sub.run(max_versions=1, timeout=10) == [v1]
        examples = run.requests(8)
        np.testing.assert_allclose(
            served_scores(sink, run, examples)[1],
            run.restored_scores(v1, examples),
            rtol=0,
            atol=INT4_ATOL,
        )
        after = template.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)  # never written
        # A trainer of another architecture takes the name over: not the template's tables.
        run.close()
        hand_over(url, "two_tower", "deepfm")
        assert sub.run(timeout=0.5) == []
        assert sub.version == v1 and sub.rejected >= 1
        assert "has tables" in (sub.last_error or "")


def test_a_factory_that_cannot_build_a_version_leaves_the_served_one(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    run = make_run(tmp_path, "deepfm", "fp32")
    known = run.checkpointer.model_config

    def factory(config: Mapping[str, Any]) -> nn.Module:
        if dict(config) != known:
            raise ValueError("not a config this server was deployed for")
        return run.build(config)

    sink = ModuleSink(factory)
    rejections = Rejections()
    with Subscriber(url, "deepfm", sink, options=FAST, observer=rejections) as sub:
        run.train(7)
        v1 = run.checkpoint()
        assert sub.run(max_versions=1, timeout=10) == [v1]
        run.close()
        wider = deepfm.DeepFMConfig(users=200, items=120, tags=16, dim=8, dense=3, hidden=32)
        hand_over(url, "deepfm", "deepfm", config=wider)
        assert sub.run(timeout=0.5) == []
        assert sub.version == v1
        assert "the model factory cannot build" in (sub.last_error or "")
        assert rejections.reasons and set(rejections.reasons) == {"layout"}


class Rejections(SubscriberObserver):
    """The reason of every version a subscriber rejected."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def rejected(self, reason: str) -> None:
        self.reasons.append(reason)


def hand_over(url: str, name: str, example: str, **options: Any) -> None:
    """A new trainer of `example` takes model `name` over and commits a full version of its
    own (a model of another architecture, or config, than the one served)."""
    successor = RUNS[example](url, name, codec="fp32", **options)
    try:
        successor.train(3)
        successor.checkpoint()
    finally:
        successor.close()


def test_a_tensor_sink_is_budgeted_by_the_tables_and_dense_state_of_two_copies(
    tmp_path: Path,
) -> None:
    run = make_run(tmp_path, "deepfm", "int4")
    try:
        run.train(7)
        version = run.checkpoint()
        manifest = restore(FileStore(tmp_path / "store"), "deepfm", version).manifest
        weights = sum(e.rows * e.dim * 4 for e in manifest.tables)
        assert manifest.served_fp32_bytes == weights + (manifest.dense_tensor_bytes or 0)
        needed = 2 * manifest.served_fp32_bytes  # the double buffer's two copies
        url = f"file://{tmp_path / 'store'}"
        with Subscriber(url, "deepfm", TensorSink(memory_budget=needed - 1), options=FAST) as sub:
            assert sub.run(timeout=0.3) == []
            assert "over the memory budget" in (sub.last_error or "")
        with Subscriber(url, "deepfm", TensorSink(memory_budget=needed), options=FAST) as sub:
            assert sub.run(max_versions=1, timeout=10) == [version]
    finally:
        run.close()
