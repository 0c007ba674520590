"""Dirty-row tracking: the bitmaps, the lookup hooks, the optimizer rules and the verifier."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from publisher.write.tracker import (
    DirtyRowTracker,
    RowIdError,
    TrackedEmbeddings,
    TrackerError,
    UnsoundOptimizerError,
    UntrackedChangeError,
    UntrackedRowVerifier,
    attach,
    check_optimizers,
    find_embedding_tables,
    soundness_problems,
)

OptFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


@pytest.fixture(autouse=True)
def _quiet_sparse_warning() -> Iterator[None]:
    # torch warns once per process about disabled sparse invariant checks in Adagrad.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        yield


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


# --- DirtyRowTracker -----------------------------------------------------------------------------


def test_mark_any_int_dtype_and_shape_gives_sorted_unique_int64() -> None:
    tracker = DirtyRowTracker({"a": 10, "b": 300})
    tracker.mark("a", np.array([[7, 1], [7, 3]], dtype=np.int16))
    tracker.mark("a", torch.tensor([[[9]]], dtype=torch.int32))
    tracker.mark("b", np.array([299, 0, 299], dtype=np.uint16))
    tracker.mark("b", torch.tensor([], dtype=torch.int64))
    peeked = tracker.peek("a")
    assert peeked.dtype == np.int64
    np.testing.assert_array_equal(peeked, ids(1, 3, 7, 9))
    np.testing.assert_array_equal(tracker.peek("b"), ids(0, 299))
    assert tracker.dirty_counts() == {"a": 4, "b": 2}
    assert dict(tracker.table_rows) == {"a": 10, "b": 300}


def test_uint8_ids_are_ids_not_a_mask() -> None:
    tracker = DirtyRowTracker({"t": 8})
    tracker.mark("t", torch.tensor([3, 1], dtype=torch.uint8))
    tracker.mark("t", np.array([5], dtype=np.uint8))
    np.testing.assert_array_equal(tracker.peek("t"), ids(1, 3, 5))


def test_snapshot_returns_every_table_and_resets() -> None:
    tracker = DirtyRowTracker({"a": 5, "b": 5})
    tracker.mark("a", ids(4, 2))
    snap = tracker.snapshot_and_reset()
    assert set(snap) == {"a", "b"}
    np.testing.assert_array_equal(snap["a"], ids(2, 4))
    assert snap["b"].dtype == np.int64
    assert snap["b"].size == 0
    assert tracker.dirty_counts() == {"a": 0, "b": 0}
    tracker.mark("b", ids(1))
    snap = tracker.snapshot_and_reset()
    assert snap["a"].size == 0
    np.testing.assert_array_equal(snap["b"], ids(1))


def test_peek_does_not_reset() -> None:
    tracker = DirtyRowTracker({"a": 5})
    tracker.mark("a", ids(3))
    tracker.peek("a")
    np.testing.assert_array_equal(tracker.snapshot_and_reset()["a"], ids(3))


@pytest.mark.parametrize("bad", [-1, 10, 2**40])
def test_out_of_range_id_names_value_and_size_and_marks_nothing(bad: int) -> None:
    tracker = DirtyRowTracker({"t": 10})
    with pytest.raises(RowIdError, match=rf"'t'.*{bad}.*\[0, 10\)"):
        tracker.mark("t", torch.tensor([1, bad, 2]))
    with pytest.raises(TrackerError):
        tracker.mark("t", np.array([1, bad, 2]))
    assert tracker.dirty_counts() == {"t": 0}


def test_huge_unsigned_numpy_id_is_rejected_not_wrapped() -> None:
    tracker = DirtyRowTracker({"t": 10})
    with pytest.raises(RowIdError, match="out of range"):
        tracker.mark("t", np.array([2**64 - 1], dtype=np.uint64))


@pytest.mark.parametrize(
    "bad",
    [torch.tensor([1.0]), torch.tensor([True]), np.array([1.0]), np.array([True])],
    ids=["torch-float", "torch-bool", "numpy-float", "numpy-bool"],
)
def test_non_integer_ids_are_rejected(bad: torch.Tensor | np.ndarray) -> None:
    tracker = DirtyRowTracker({"t": 10})
    with pytest.raises(RowIdError, match="integers"):
        tracker.mark("t", bad)


def test_unknown_table_and_bad_sizes() -> None:
    tracker = DirtyRowTracker({"t": 10})
    with pytest.raises(TrackerError, match="unknown table 'u'"):
        tracker.mark("u", ids(1))
    with pytest.raises(TrackerError, match="unknown table"):
        tracker.peek("u")
    with pytest.raises(TrackerError, match="row count"):
        DirtyRowTracker({"t": -1})


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=999), max_size=200),
    st.sampled_from([np.int8, np.int32, np.int64, np.uint16, np.uint32]),
    st.booleans(),
)
def test_marks_equal_unique_ids(values: list[int], dtype: type, as_torch: bool) -> None:
    tracker = DirtyRowTracker({"t": 1000})
    arr = np.array(values, dtype=np.int64)
    arr = arr[arr <= np.iinfo(dtype).max].astype(dtype)
    tracker.mark("t", torch.from_numpy(arr.astype(np.int64)) if as_torch else arr)
    np.testing.assert_array_equal(tracker.snapshot_and_reset()["t"], np.unique(arr))


def test_concurrent_marks_land_in_exactly_one_snapshot() -> None:
    rows, threads, chunk = 200_000, 4, 7
    tracker = DirtyRowTracker({"t": rows, "u": 64})
    per_thread = np.array_split(np.random.default_rng(0).permutation(rows), threads)
    start = threading.Barrier(threads + 1)

    def worker(mine: np.ndarray) -> None:
        start.wait()
        for i in range(0, mine.size, chunk):
            tracker.mark("t", torch.from_numpy(mine[i : i + chunk]))
            tracker.mark("u", mine[i : i + 1] % 64)

    workers = [threading.Thread(target=worker, args=(m,)) for m in per_thread]
    for w in workers:
        w.start()
    start.wait()
    snapshots = []
    while any(w.is_alive() for w in workers):
        snapshots.append(tracker.snapshot_and_reset()["t"])
    for w in workers:
        w.join()
    snapshots.append(tracker.snapshot_and_reset()["t"])

    assert len(snapshots) > 2  # the snapshots really interleaved with the marks
    every = np.concatenate(snapshots)
    assert every.size == rows  # each id was marked once: no snapshot saw it twice
    np.testing.assert_array_equal(np.sort(every), np.arange(rows))


# --- hooks ---------------------------------------------------------------------------------------


class Tower(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.items = nn.EmbeddingBag(60, 4, mode="sum", sparse=sparse)


class Rec(nn.Module):
    """A small recommendation model: user embedding, nested item bag, dense MLP."""

    def __init__(self, sparse: bool = True) -> None:
        super().__init__()
        self.user = nn.Embedding(40, 4, sparse=sparse)
        self.tower = Tower(sparse)
        self.mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(
        self, user: torch.Tensor, items: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:
        bag = self.tower.items(items, offsets, per_sample_weights=w)
        score: torch.Tensor = self.mlp(torch.cat([self.user(user), bag], dim=1))
        return score.squeeze(1)


def test_find_embedding_tables_by_qualified_name_in_module_order() -> None:
    model = Rec()
    tables = find_embedding_tables(model)
    assert list(tables) == ["user", "tower.items"]
    assert tables["tower.items"] is model.tower.items


def test_embedding_hook_marks_ids_of_any_shape() -> None:
    emb = nn.Embedding(20, 3)
    tracked = attach(nn.Sequential(emb))
    emb(torch.tensor([[1, 2], [2, 5]]))
    emb(input=torch.tensor([[[11]]], dtype=torch.int32))
    np.testing.assert_array_equal(tracked.tracker.peek("0"), ids(1, 2, 5, 11))


def test_embedding_bag_2d_input() -> None:
    model = Rec()
    tracked = attach(model)
    model.tower.items(torch.tensor([[3, 4], [4, 59]]))
    np.testing.assert_array_equal(tracked.tracker.peek("tower.items"), ids(3, 4, 59))
    assert tracked.tracker.peek("user").size == 0


@pytest.mark.parametrize("form", ["positional", "keyword", "mixed"])
def test_embedding_bag_1d_offsets_and_per_sample_weights(form: str) -> None:
    bag = nn.EmbeddingBag(30, 2, mode="sum")
    tracked = attach(nn.ModuleDict({"bag": bag}))
    flat, offsets, w = torch.tensor([7, 1, 7, 29]), torch.tensor([0, 1]), torch.rand(4)
    if form == "positional":
        bag(flat, offsets, w)
    elif form == "keyword":
        bag(input=flat, offsets=offsets, per_sample_weights=w)
    else:
        bag(flat, offsets=offsets, per_sample_weights=w)
    np.testing.assert_array_equal(tracked.tracker.peek("bag"), ids(1, 7, 29))


def test_embedding_bag_1d_offsets_without_weights() -> None:
    bag = nn.EmbeddingBag(30, 2, mode="mean", padding_idx=0)
    tracked = attach(nn.ModuleDict({"bag": bag}))
    bag(torch.tensor([0, 4, 5]), torch.tensor([0, 2]))
    np.testing.assert_array_equal(tracked.tracker.peek("bag"), ids(0, 4, 5))


def test_no_grad_and_inference_mode_do_not_mark() -> None:
    model = Rec()
    tracked = attach(model)
    x = torch.tensor([[1, 2]])
    model.eval()
    with torch.no_grad():
        model.user(x)
    model.train()
    with torch.no_grad():
        model.user(x)
    with torch.inference_mode():
        model.tower.items(x)
    assert tracked.tracker.dirty_counts() == {"user": 0, "tower.items": 0}


def test_eval_mode_with_grad_marks_because_it_can_be_trained() -> None:
    # Training in eval mode (to freeze dropout / batch-norm) changes the looked-up rows.
    emb = nn.Embedding(10, 2)
    tracked = attach(nn.Sequential(emb))
    emb.eval()
    before = emb.weight.detach().clone()
    opt = torch.optim.SGD(emb.parameters(), lr=0.5)
    emb(torch.tensor([4, 6])).sum().backward()
    opt.step()
    changed = (emb.weight.detach() != before).any(1).nonzero().flatten().numpy()
    np.testing.assert_array_equal(changed, ids(4, 6))
    np.testing.assert_array_equal(tracked.tracker.peek("0"), ids(4, 6))


def test_frozen_table_lookups_are_not_marked() -> None:
    emb = nn.Embedding(10, 2)
    emb.weight.requires_grad_(False)
    tracked = attach(nn.Sequential(emb))
    emb(torch.tensor([1]))
    assert tracked.tracker.dirty_counts() == {"0": 0}


def test_max_norm_lookups_are_marked_even_without_grad() -> None:
    # max_norm renormalises looked-up rows in place on every forward, in any mode.
    emb = nn.Embedding(10, 2, max_norm=0.01)
    tracked = attach(nn.Sequential(emb))
    before = emb.weight.detach().clone()
    emb.eval()
    with torch.no_grad():
        emb(torch.tensor([2, 8]))
    changed = (emb.weight.detach() != before).any(1).nonzero().flatten().numpy()
    np.testing.assert_array_equal(changed, ids(2, 8))
    np.testing.assert_array_equal(tracked.tracker.peek("0"), ids(2, 8))


def test_out_of_range_lookup_raises_tracker_error_before_forward() -> None:
    emb = nn.Embedding(10, 2)
    attach(nn.Sequential(emb))
    with pytest.raises(RowIdError, match=r"row id 10 out of range \[0, 10\)"):
        emb(torch.tensor([3, 10]))


def test_detach_stops_marking_and_context_manager_detaches() -> None:
    emb = nn.Embedding(10, 2)
    tracked = attach(nn.Sequential(emb))
    tracked.detach()
    tracked.detach()  # idempotent
    assert not tracked.attached
    emb(torch.tensor([1]))
    assert tracked.tracker.dirty_counts() == {"0": 0}
    with attach(nn.Sequential(emb)) as again:
        assert isinstance(again, TrackedEmbeddings)
        emb(torch.tensor([2]))
    emb(torch.tensor([3]))
    np.testing.assert_array_equal(again.tracker.peek("0"), ids(2))


def test_attach_with_given_tracker_must_match_the_model() -> None:
    model = Rec()
    tracker = DirtyRowTracker({"user": 40, "tower.items": 60})
    assert attach(model, tracker).tracker is tracker
    with pytest.raises(TrackerError, match="differ"):
        attach(model, DirtyRowTracker({"user": 40, "tower.items": 61}))
    with pytest.raises(TrackerError, match="differ"):
        attach(model, DirtyRowTracker({"user": 40}))
    with pytest.raises(TrackerError, match=r"no nn\.Embedding"):
        attach(nn.Linear(2, 2))


# --- soundness on a real model ------------------------------------------------------------------


def batch(rng: np.random.Generator, n: int = 6) -> tuple[torch.Tensor, ...]:
    # Users and items from a narrow range, so most rows are not looked up in a step.
    user = torch.from_numpy(rng.integers(0, 8, n))
    lengths = rng.integers(1, 4, n)
    items = torch.from_numpy(rng.integers(0, 12, int(lengths.sum())))
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)[:-1]]))
    w = torch.rand(items.numel())
    return user, items, offsets, w


def row_state(optimizers: list[torch.optim.Optimizer], weight: torch.Tensor) -> torch.Tensor:
    """The weight and every optimizer state tensor shaped like it, side by side per row."""
    parts = [weight.detach()]
    for opt in optimizers:
        for value in opt.state.get(weight, {}).values():
            if isinstance(value, torch.Tensor) and value.shape == weight.shape:
                parts.append(value.detach().to_dense())
    return torch.cat(parts, dim=1).clone()


def changed_rows(before: torch.Tensor, after: torch.Tensor) -> np.ndarray:
    moved = (before.view(torch.int32) != after.view(torch.int32)).any(dim=1)
    return moved.nonzero().flatten().numpy()


SOUND_SETUPS: dict[str, tuple[bool, OptFactory]] = {
    "sparse+Adagrad": (True, lambda p: torch.optim.Adagrad(p, lr=0.3, lr_decay=0.01)),
    "sparse+SparseAdam": (True, lambda p: torch.optim.SparseAdam(p, lr=0.3)),
    "sparse+SGD": (True, lambda p: torch.optim.SGD(p, lr=0.3)),
    "dense+SGD": (False, lambda p: torch.optim.SGD(p, lr=0.3)),
    "dense+Adagrad": (False, lambda p: torch.optim.Adagrad(p, lr=0.3)),
}


@pytest.mark.parametrize("at_step", [False, True], ids=["marked-at-lookup", "marked-at-step"])
@pytest.mark.parametrize("setup", list(SOUND_SETUPS))
def test_sound_setup_tracker_covers_every_changed_row_and_state(setup: str, at_step: bool) -> None:
    sparse, make_opt = SOUND_SETUPS[setup]
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = Rec(sparse=sparse)
    emb_params = [model.user.weight, model.tower.items.weight]
    optimizers = [make_opt(emb_params), torch.optim.Adam(model.mlp.parameters(), lr=0.01)]
    tracked = attach(model, optimizers=optimizers if at_step else ())
    check_optimizers(model, optimizers)  # Adam on the dense part does not matter
    verifier = UntrackedRowVerifier(tracked.tables, sample=1000, seed=1)

    def step() -> None:
        for opt in optimizers:
            opt.zero_grad()
        user, items, offsets, w = batch(rng)
        F.mse_loss(model(user, items, offsets, w), torch.rand(user.numel())).backward()
        for opt in optimizers:
            opt.step()

    step()  # optimizer state is created lazily; compare once it exists
    tracked.tracker.snapshot_and_reset()
    for _ in range(4):
        verifier.before()
        before = {n: row_state(optimizers, m.weight) for n, m in tracked.tables.items()}
        step()
        step()
        dirty = tracked.tracker.snapshot_and_reset()
        for name, module in tracked.tables.items():
            changed = changed_rows(before[name], row_state(optimizers, module.weight))
            assert changed.size > 0
            assert dirty[name].size < module.num_embeddings  # not vacuous: rows stayed clean
            assert np.isin(changed, dirty[name]).all(), (name, changed, dirty[name])
        assert verifier.after(dirty) > 0


def lookup_hooks(model: nn.Module) -> dict[str, int]:
    return {n: len(m._forward_pre_hooks) for n, m in find_embedding_tables(model).items()}


def test_sparse_tables_in_the_optimizers_are_marked_at_the_step_not_per_lookup() -> None:
    model = Rec(sparse=True)
    opt = torch.optim.SGD([model.user.weight, model.tower.items.weight], lr=0.1)
    tracked = attach(model, optimizers=[opt])
    assert lookup_hooks(model) == {"user": 0, "tower.items": 0}
    user, items = torch.tensor([3, 5]), torch.tensor([7, 8, 9])
    offsets, w = torch.tensor([0, 1]), torch.ones(3)
    model(user, items, offsets, w).sum().backward()
    # Gradient accumulated for a later step changes nothing yet: nothing is dirty.
    assert tracked.tracker.dirty_counts() == {"user": 0, "tower.items": 0}
    model(torch.tensor([1, 3]), torch.tensor([2, 2]), offsets, torch.ones(2)).sum().backward()
    before = model.user.weight.detach().clone()
    opt.step()
    np.testing.assert_array_equal(tracked.tracker.peek("user"), ids(1, 3, 5))
    np.testing.assert_array_equal(tracked.tracker.peek("tower.items"), ids(2, 7, 8, 9))
    changed = (model.user.weight.detach() != before).any(1).nonzero().flatten().numpy()
    np.testing.assert_array_equal(changed, ids(1, 3, 5))
    tracked.detach()
    opt.step()
    assert tracked.tracker.snapshot_and_reset()["user"].size == 3
    opt.step()
    assert tracked.tracker.dirty_counts() == {"user": 0, "tower.items": 0}


def test_tables_the_step_cannot_see_keep_the_lookup_hook() -> None:
    # Dense gradients, max_norm (renormalised by the forward itself) and a weight in no listed
    # optimizer are marked per lookup even when optimizers are given.
    model = nn.ModuleDict(
        {
            "dense": nn.Embedding(10, 2),
            "max_norm": nn.Embedding(10, 2, sparse=True, max_norm=0.01),
            "unlisted": nn.Embedding(10, 2, sparse=True),
            "listed": nn.Embedding(10, 2, sparse=True),
        }
    )
    opt = torch.optim.SGD([model[k].weight for k in ("dense", "max_norm", "listed")], lr=0.1)
    tracked = attach(model, optimizers=[opt])
    assert lookup_hooks(model) == {"dense": 1, "max_norm": 1, "unlisted": 1, "listed": 0}
    for name in ("dense", "max_norm", "unlisted", "listed"):
        model[name](torch.tensor([4]))
    assert tracked.tracker.dirty_counts() == {
        "dense": 1,
        "max_norm": 1,
        "unlisted": 1,
        "listed": 0,
    }


def test_snapshots_reuse_cleared_bitmaps() -> None:
    tracker = DirtyRowTracker({"t": 100})
    for round_ in range(4):
        marked = np.arange(round_, 100, 7)
        tracker.mark("t", marked)
        np.testing.assert_array_equal(tracker.snapshot_and_reset()["t"], marked)
        assert tracker.dirty_counts() == {"t": 0}


def test_verifier_catches_deliberately_modified_untracked_row() -> None:
    model = Rec()
    tracked = attach(model)
    verifier = UntrackedRowVerifier(tracked.tables, sample=1000, seed=0)
    verifier.before()
    model.user(torch.tensor([1, 2]))
    with torch.no_grad():
        model.user.weight[2] += 1.0  # tracked: fine
        model.tower.items.weight[33, 0] = -model.tower.items.weight[33, 0]  # untracked
    with pytest.raises(UntrackedChangeError, match=r"'tower.items'.*\[33\]") as info:
        verifier.after(tracked.tracker.snapshot_and_reset())
    assert set(info.value.rows) == {"tower.items"}
    np.testing.assert_array_equal(info.value.rows["tower.items"], ids(33))


def test_verifier_is_bitwise_and_catches_sign_of_zero() -> None:
    weight = torch.zeros(5, 2)
    verifier = UntrackedRowVerifier({"t": weight}, sample=5)
    verifier.before()
    weight[4, 1] = -0.0  # numerically equal, bitwise different
    with pytest.raises(UntrackedChangeError):
        verifier.after({})


def test_verifier_samples_at_most_sample_rows_and_needs_before() -> None:
    verifier = UntrackedRowVerifier({"t": torch.zeros(100, 3)}, sample=16, seed=3)
    with pytest.raises(TrackerError, match="without before"):
        verifier.after({})
    verifier.before()
    assert verifier.armed
    assert verifier.after({"t": np.arange(100)}) == 0
    verifier.before()
    assert verifier.after({}) == 16
    assert not verifier.armed


def test_verifier_catches_weight_used_outside_its_module() -> None:
    # A tied output projection through F.linear: every row gets a gradient; no hook sees it.
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(30, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(self.emb(x), self.emb.weight)

    model = Tied()
    tracked = attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    check_optimizers(model, [opt])  # statically invisible
    verifier = UntrackedRowVerifier(tracked.tables, sample=30)
    verifier.before()
    F.cross_entropy(model(torch.tensor([1, 2])), torch.tensor([3, 4])).backward()
    opt.step()
    with pytest.raises(UntrackedChangeError, match="'emb'"):
        verifier.after(tracked.tracker.snapshot_and_reset())


# --- the optimizer rules match what torch does ---------------------------------------------------


TRUTH_SETUPS: dict[str, tuple[bool, OptFactory]] = {
    "SGD": (False, lambda p: torch.optim.SGD(p, lr=0.1)),
    "SGD maximize": (False, lambda p: torch.optim.SGD(p, lr=0.1, maximize=True)),
    "SGD momentum": (False, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    "SGD nesterov": (False, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True)),
    "SGD weight_decay": (False, lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.01)),
    "Adagrad": (False, lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.1)),
    "Adagrad weight_decay": (False, lambda p: torch.optim.Adagrad(p, lr=0.1, weight_decay=0.1)),
    "SparseAdam": (False, lambda p: torch.optim.SparseAdam(p, lr=0.1)),
    "Adam": (False, lambda p: torch.optim.Adam(p, lr=0.1)),
    "AdamW": (False, lambda p: torch.optim.AdamW(p, lr=0.1)),
    "Adamax": (False, lambda p: torch.optim.Adamax(p, lr=0.1)),
    "NAdam": (False, lambda p: torch.optim.NAdam(p, lr=0.1)),
    "RAdam": (False, lambda p: torch.optim.RAdam(p, lr=0.1)),
    "RMSprop": (False, lambda p: torch.optim.RMSprop(p, lr=0.1)),
    "RMSprop centered": (False, lambda p: torch.optim.RMSprop(p, lr=0.1, centered=True)),
    "Adadelta": (False, lambda p: torch.optim.Adadelta(p, lr=0.1)),
}
TRUTH_CASES = [(name, sparse) for name in TRUTH_SETUPS for sparse in (False, True)]


def trains_soundly(
    sparse: bool, make_opt: OptFactory
) -> tuple[bool, nn.Module, list[torch.optim.Optimizer]]:
    """Train 4 steps on disjoint ids; sound = no error and no unlooked-up row or state moved.

    The first step only creates the optimizer state (it starts at zero, so from-zero moments
    move nothing yet); steps 2..4 are measured.
    """
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(50, 4, mode="sum", sparse=sparse)
    model = nn.ModuleDict({"bag": bag})
    opt = make_opt([bag.weight])
    sound = True
    try:
        for step in range(4):
            looked_up = torch.tensor([[3 * step, 3 * step + 1]])
            before = row_state([opt], bag.weight)
            opt.zero_grad()
            bag(looked_up).pow(2).sum().backward()
            opt.step()
            if step > 0:
                changed = changed_rows(before, row_state([opt], bag.weight))
                sound &= bool(np.isin(changed, looked_up.numpy()).all())
    except RuntimeError:  # torch refuses this optimizer/gradient combination
        sound = False
    return sound, model, [opt]


@pytest.mark.parametrize(("name", "sparse"), TRUTH_CASES)
def test_optimizer_rules_match_measured_torch_behaviour(name: str, sparse: bool) -> None:
    make_opt = TRUTH_SETUPS[name][1]
    sound, model, optimizers = trains_soundly(sparse, make_opt)
    problems = soundness_problems(model, optimizers)
    assert (not problems) == sound, (name, sparse, [str(p) for p in problems])


def test_unsound_setups_raise_naming_table_and_optimizer() -> None:
    model = Rec(sparse=False)
    sgd = torch.optim.SGD([model.user.weight], lr=0.1, momentum=0.9)
    adam = torch.optim.Adam([model.tower.items.weight, *model.mlp.parameters()])
    with pytest.raises(UnsoundOptimizerError) as info:
        check_optimizers(model, [sgd, adam])
    message = str(info.value)
    assert "table 'user', optimizers[0] (SGD): momentum=0.9" in message
    assert "table 'tower.items', optimizers[1] (Adam)" in message
    assert "sparse=True" in message  # says how to fix
    assert [(p.table, p.optimizer) for p in info.value.problems] == [
        ("user", "optimizers[0] (SGD)"),
        ("tower.items", "optimizers[1] (Adam)"),
    ]


def test_param_group_hyperparameters_are_checked_per_group() -> None:
    model = Rec(sparse=False)
    groups: list[dict[str, Any]] = [
        {"params": [model.user.weight]},
        {"params": [model.tower.items.weight], "weight_decay": 0.01},
    ]
    opt = torch.optim.SGD(groups, lr=0.1)
    problems = soundness_problems(model, [opt])
    assert [p.table for p in problems] == ["tower.items"]
    assert "weight_decay" in problems[0].reason


def test_unknown_optimizer_is_refused_and_row_wise_marker_is_trusted() -> None:
    model = Rec(sparse=False)
    with pytest.raises(UnsoundOptimizerError, match=r"unknown optimizer class.*Rprop"):
        check_optimizers(model, [torch.optim.Rprop(model.parameters())])

    class SubSGD(torch.optim.SGD):
        pass

    with pytest.raises(UnsoundOptimizerError, match="unknown optimizer class"):
        check_optimizers(model, [SubSGD(model.parameters(), lr=0.1)])

    class RowWise(torch.optim.Adam):
        sparse_row_updates = True

    check_optimizers(model, [RowWise(model.parameters())])


def test_frozen_weights_and_weights_in_no_optimizer_pass() -> None:
    model = Rec(sparse=False)
    model.user.weight.requires_grad_(False)
    check_optimizers(model, [torch.optim.Adam([model.user.weight, *model.mlp.parameters()])])


def test_weight_shared_with_another_module_is_reported() -> None:
    model = Rec()
    head = nn.Linear(4, 40, bias=False)
    head.weight = model.user.weight
    model.head = head
    problems = soundness_problems(model, [torch.optim.SGD(model.parameters(), lr=0.1)])
    assert [(p.table, p.optimizer) for p in problems] == [("user", "")]
    assert "'head.weight'" in problems[0].reason
