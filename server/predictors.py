"""How a predict request becomes scores for the served model: the built-in DLRM's request
format, or a user's request adapter for a model of their own (docs/SERVER.md, "Your own
model").

A predictor works in two steps so that the served version is borrowed only for the second:

- `check(examples, copy, now)`: every value checked against the model the copy holds (one pass
  over the body, a capped report, server/feature_problems.py), raw ids made canonical;
- `score(checked, copy)`, under the reader: raw ids mapped with that copy's id maps (the rows
  and the maps read are one version's), the module's forward, the scores (B,).

`DLRMPredictor` is the built-in model's: encoded ids (server/feature_batch.py) or, for a model
trained from raw events, raw ids and derived dense inputs (server/raw_ids.py).

`AdapterPredictor` is any other model's, with the user's request adapter: an object with
`inputs(examples) -> args` (a tuple: `module(*args)`; a mapping: `module(**args)`; anything
else: `module(args)`), `scores(output) -> Tensor (B,)` (probabilities), and optionally
`id_features`, a mapping of request field -> table: the server maps that field's raw ids (a
string or integer, or a list of them; null or absent: none) with the table's id map of the
served version before `inputs` sees the example (an id the version does not know takes row 0,
the unknown row, and is counted in `unknown_ids`), and `features`, names listed by
`GET /v1/model`. The adapter is built by `--request-adapter MODULE:FUNCTION` from the served
version's `model_config` (once per copy). A `ValueError` (or `KeyError`, `TypeError`) raised by
`inputs` is the client's mistake: a 422 with its message.
"""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from publisher.dlrm import DLRMConfig
from publisher.id_map import UNKNOWN_ROW, IdMap
from publisher.live_features import LiveSpec, live_spec_of
from publisher.read import ModelCopy, NotBootstrappedError, ServedVersion, VersionSink
from server.api_models import FeatureKind
from server.errors import shown_input
from server.feature_batch import FeatureBatch, build_batch, check_scores
from server.feature_columns import build_columnar_batch, examples_as_columns
from server.feature_problems import FeatureValidationError, Problems
from server.raw_ids import RawExamples, keys_of, parse_raw_examples
from server.v2_tensors import BatchTooLargeError

#: examples from which a batch of encoded ids is checked as columns: measured (bench_config,
#: Intel Xeon) 0.025 vs 0.052 ms at 1 example, 0.33 vs 0.11 ms at 64, 4.8 vs 0.74 ms at 1024.
COLUMNS_FROM = 8
#: the largest number of problems an adapter's refusal is reported with.
_ADAPTER_MESSAGE_CHARS = 300


@dataclass(frozen=True)
class Scored:
    """What a predictor computed for a batch, against the copy it borrowed."""

    scores: torch.Tensor  # float32 (B,), probabilities
    #: raw ids sent per feature, and of them those the version does not know (row 0); None for
    #: a model taking encoded ids only.
    ids: dict[str, int] | None = None
    unknown_ids: dict[str, int] | None = None


@dataclass(frozen=True)
class FeatureSpec:
    """One input of the served model, as `GET /v1/model` lists it."""

    name: str
    kind: FeatureKind
    rows: int | None = None


@dataclass(frozen=True)
class IdSpace:
    """How the served model maps raw ids, as `GET /v1/model` shows it."""

    tables: dict[str, str] = field(default_factory=dict)  # feature -> table
    count_features: tuple[str, ...] = ()
    time_features: bool = False
    #: (name, transform) of each dense feature a request sends (docs/FORMAT.md 8.4).
    dense_features: tuple[tuple[str, str], ...] = ()


class Predictor(ABC):
    """Turns a request's examples into scores for the model a copy holds."""

    @abstractmethod
    def check(self, examples: Sequence[object], copy: ModelCopy, now: float) -> object:
        """`examples` checked for `copy`'s model (FeatureValidationError listing what is
        wrong); `copy` is read for its model only, not borrowed."""

    @abstractmethod
    def score(self, checked: object, copy: ModelCopy) -> Scored:
        """Scores of checked examples against `copy` (borrowed by the caller)."""

    @abstractmethod
    def features(self, copy: ModelCopy) -> list[FeatureSpec]:
        """The inputs of `copy`'s model."""

    def id_space(self, copy: ModelCopy) -> IdSpace | None:
        """How raw ids are mapped, or None when the model takes none."""
        return None

    def predict(
        self, sink: VersionSink, examples: Sequence[object], now: float
    ) -> tuple[Scored, ServedVersion]:
        """`examples` scored against one version of `sink` (and that version): checked before
        the model is borrowed, again only if the model changed meanwhile; FeatureValidationError
        for what is wrong with them or an example given no finite score, NotBootstrappedError
        before the first version."""
        scored = self._borrowed(sink, lambda copy: self.check(examples, copy, now))
        assert scored is not None  # check() always gives something to score
        return scored

    def _borrowed(
        self, sink: VersionSink, prepare: Callable[[ModelCopy], object | None]
    ) -> tuple[Scored, ServedVersion] | None:
        """What `prepare(copy)` makes of the request scored against one version: prepared
        before the model is borrowed, again only if the model changed meanwhile; None when
        `prepare` gives None (the request is not for this path)."""
        current = sink.current()
        if current is None:
            raise NotBootstrappedError("no version is served yet")
        prepared = prepare(current)
        if prepared is None:
            return None
        with sink.reader() as copy:
            if copy is not current and copy.model_config != current.model_config:
                prepared = prepare(copy)
                if prepared is None:
                    return None
            scored = self.score(prepared, copy)
            served = copy.served
        assert served is not None
        check_scores(scored.scores, served.version)
        return scored, served

    def hashing(self, copy: ModelCopy) -> bool:
        """Whether ids outside a table are folded in by modulo."""
        return False

    def predict_columns(
        self, sink: VersionSink, tensors: Mapping[str, np.ndarray], now: float, *, max_batch: int
    ) -> tuple[Scored, ServedVersion] | None:
        """`tensors` (a v2 request's, one per input) scored against one version, built
        column by column with no per-example step; None when this predictor takes examples
        only (the caller then makes examples of them)."""
        return None


def _forward(module: object, args: object) -> object:
    with torch.inference_mode():
        if isinstance(args, tuple | list):
            return module(*args)  # type: ignore[operator]
        if isinstance(args, Mapping):
            return module(**args)  # type: ignore[operator]
        return module(args)  # type: ignore[operator]


class _PerCopy:
    """A value derived from each copy's model once (a parsed config, an adapter), kept as long
    as the copy lives."""

    def __init__(self, make: Callable[[ModelCopy], Any]) -> None:
        self._make = make
        self._values: weakref.WeakKeyDictionary[ModelCopy, Any] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def __call__(self, copy: ModelCopy) -> Any:
        with self._lock:
            if copy in self._values:
                return self._values[copy]
        value = self._make(copy)
        with self._lock:
            return self._values.setdefault(copy, value)


# --- the built-in DLRM ---------------------------------------------------------------------


def _dlrm_of(copy: ModelCopy) -> tuple[DLRMConfig, LiveSpec | None]:
    config = DLRMConfig.from_json(copy.model_config)
    return config, live_spec_of(config)


class DLRMPredictor(Predictor):
    """The built-in DLRM's requests (server/feature_batch.py, server/raw_ids.py)."""

    def __init__(self, *, max_ids_per_bag: int = 4096) -> None:
        self.max_ids_per_bag = max_ids_per_bag
        self._model = _PerCopy(_dlrm_of)

    def model(self, copy: ModelCopy) -> tuple[DLRMConfig, LiveSpec | None]:
        """`copy`'s DLRM config and live spec (None: a model of encoded ids)."""
        found: tuple[DLRMConfig, LiveSpec | None] = self._model(copy)
        return found

    def check(self, examples: Sequence[object], copy: ModelCopy, now: float) -> object:
        config, spec = self.model(copy)
        if spec is None:
            columns = (
                examples_as_columns(examples, config) if len(examples) >= COLUMNS_FROM else None
            )
            if columns is not None:  # well-formed: checked column by column
                try:
                    return build_columnar_batch(
                        columns, config, max_ids_per_bag=self.max_ids_per_bag
                    )
                except FeatureValidationError:
                    pass  # reported example by example, as below
            return build_batch(examples, config, max_ids_per_bag=self.max_ids_per_bag)
        return parse_raw_examples(examples, spec, now=now, max_ids_per_bag=self.max_ids_per_bag)

    def score(self, checked: object, copy: ModelCopy) -> Scored:
        ids = unknown = None
        if isinstance(checked, RawExamples):
            mapped = checked.to_batch(copy.id_maps)
            batch = mapped.batch
            ids, unknown = mapped.ids, mapped.unknown_ids
        else:
            assert isinstance(checked, FeatureBatch)
            batch = checked
        logits = _forward(copy.module, (batch.dense, batch.sparse))
        assert isinstance(logits, torch.Tensor)
        return Scored(torch.sigmoid(logits), ids, unknown)

    def predict_columns(
        self, sink: VersionSink, tensors: Mapping[str, np.ndarray], now: float, *, max_batch: int
    ) -> tuple[Scored, ServedVersion] | None:
        """A model of encoded ids: server/feature_columns.py; raw ids take examples (None)."""
        return self._borrowed(sink, lambda copy: self._columns(tensors, copy, max_batch))

    def _columns(
        self, tensors: Mapping[str, np.ndarray], copy: ModelCopy, max_batch: int
    ) -> FeatureBatch | None:
        config, spec = self.model(copy)
        if spec is not None:
            return None
        batch = build_columnar_batch(tensors, config, max_ids_per_bag=self.max_ids_per_bag)
        if batch.size > max_batch:
            raise BatchTooLargeError(
                f"batch of {batch.size} examples exceeds the cap of {max_batch}"
            )
        return batch

    def features(self, copy: ModelCopy) -> list[FeatureSpec]:
        config, spec = self.model(copy)
        if spec is None:
            found = [FeatureSpec(d, "dense") for d in config.dense]
        else:  # what a client sends: the dense features; the model's dense inputs are derived
            given = {name for d in spec.dense_features for name in d.input_names}
            found = [FeatureSpec(d, "derived") for d in config.dense if d not in given]
            found += [FeatureSpec(name, "dense") for name in spec.dense_feature_names]
        found += [FeatureSpec(f.name, "bag" if f.bag else "sparse", f.rows) for f in config.sparse]
        return found

    def id_space(self, copy: ModelCopy) -> IdSpace | None:
        config, spec = self.model(copy)
        if spec is None:
            return None
        return IdSpace(
            dict(config.table_names),
            spec.count_features,
            spec.time_features,
            tuple((d.name, d.transform) for d in spec.dense_features),
        )

    def hashing(self, copy: ModelCopy) -> bool:
        return self.model(copy)[0].hashing


# --- a user's model ------------------------------------------------------------------------


class RequestAdapter(Protocol):
    """What `--request-adapter MODULE:FUNCTION` returns for a version's `model_config`."""

    def inputs(self, examples: Sequence[Mapping[str, Any]]) -> Any: ...

    def scores(self, output: Any) -> torch.Tensor: ...


#: builds the request adapter of a served version from its `model_config`.
AdapterFactory = Callable[[Mapping[str, Any]], RequestAdapter]


class RequestAdapterError(RuntimeError):
    """The request adapter failed in a way that is not the client's doing (it could not be
    built for the served version, or returned scores of the wrong shape): a 500."""


@dataclass(frozen=True)
class _AdapterExamples:
    """Examples checked for an adapter: their raw ids of each id feature made canonical."""

    examples: list[Mapping[str, Any]]
    #: field -> per example: None (no id), one key, or a list of keys.
    keys: dict[str, list[str | list[str] | None]]


class AdapterPredictor(Predictor):
    """A user's model behind their request adapter (see the module docstring)."""

    def __init__(self, adapter_factory: AdapterFactory, *, max_ids_per_bag: int = 4096) -> None:
        self.max_ids_per_bag = max_ids_per_bag
        self._factory = adapter_factory
        self._adapter = _PerCopy(self._build)

    def _build(self, copy: ModelCopy) -> RequestAdapter:
        try:
            adapter = self._factory(copy.model_config)
        except Exception as exc:
            raise RequestAdapterError(
                f"the request adapter cannot be built for version {copy.version}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        for method in ("inputs", "scores"):
            if not callable(getattr(adapter, method, None)):
                raise RequestAdapterError(f"the request adapter has no {method}() method")
        return adapter

    def adapter(self, copy: ModelCopy) -> RequestAdapter:
        """The adapter of `copy`'s version (RequestAdapterError if it cannot be built)."""
        found: RequestAdapter = self._adapter(copy)
        return found

    def _id_features(self, copy: ModelCopy) -> dict[str, str]:
        declared = getattr(self.adapter(copy), "id_features", None) or {}
        return {str(k): str(v) for k, v in dict(declared).items()}

    def check(self, examples: Sequence[object], copy: ModelCopy, now: float) -> object:
        problems = Problems()
        id_features = self._id_features(copy)
        checked: list[Mapping[str, Any]] = []
        keys: dict[str, list[str | list[str] | None]] = {f: [] for f in id_features}
        for i, example in enumerate(examples):
            if not isinstance(example, Mapping):
                problems.add(
                    i, None, f"an example is an object, got {type(example).__name__}", "wrong_type"
                )
                continue
            checked.append(example)
            for name in id_features:
                got = self._keys(example.get(name), name)
                if isinstance(got, tuple):
                    problems.add(i, name, *got)
                    got = None
                keys[name].append(got)
        problems.raise_if_any()
        return _AdapterExamples(checked, keys)

    def _keys(self, value: object, name: str) -> str | list[str] | tuple[str, str] | None:
        """The canonical key(s) of one raw-id value (a list is a bag), or (message, type) of
        what is wrong: the DLRM's raw-id rule (`server.raw_ids.keys_of`)."""
        if value is None:
            return None
        bag = isinstance(value, list)
        got = keys_of(value, name, bag, self.max_ids_per_bag)
        return got if bag or isinstance(got, tuple) else got[0]

    def score(self, checked: object, copy: ModelCopy) -> Scored:
        assert isinstance(checked, _AdapterExamples)
        adapter = self.adapter(copy)
        examples: Sequence[Mapping[str, Any]] = checked.examples
        ids: dict[str, int] = {}
        unknown: dict[str, int] = {}
        if checked.keys:
            mapped = [dict(example) for example in examples]
            for name, table in self._id_features(copy).items():
                id_map = copy.id_maps.get(table)
                if id_map is None:
                    raise RequestAdapterError(
                        f"the adapter maps {name!r} with table {table!r}'s id map, which "
                        f"version {copy.version} does not have (its maps: "
                        f"{sorted(copy.id_maps)})"
                    )
                ids[name], unknown[name] = _map_ids(id_map, name, checked.keys[name], mapped)
            examples = mapped
        try:
            args = adapter.inputs(examples)
        except (ValueError, KeyError, TypeError) as exc:
            problems = Problems()
            problems.add(None, None, shown_input(str(exc), _ADAPTER_MESSAGE_CHARS), "invalid")
            problems.raise_if_any()
        output = _forward(copy.module, args)
        scores = adapter.scores(output)
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != (len(examples),):
            shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores)
            raise RequestAdapterError(
                f"the request adapter's scores() returned {shape} for {len(examples)} examples; "
                "expected a tensor of one score per example"
            )
        return Scored(scores.float(), ids or None, unknown or None)

    def features(self, copy: ModelCopy) -> list[FeatureSpec]:
        adapter = self.adapter(copy)
        found = [FeatureSpec(name, "raw_id") for name in self._id_features(copy)]
        for name in getattr(adapter, "features", None) or ():
            if str(name) not in {f.name for f in found}:
                found.append(FeatureSpec(str(name), "input"))
        return found

    def id_space(self, copy: ModelCopy) -> IdSpace | None:
        tables = self._id_features(copy)
        return IdSpace(tables) if tables else None


def _map_ids(
    id_map: IdMap,
    name: str,
    keys: list[str | list[str] | None],
    examples: list[dict[str, Any]],
) -> tuple[int, int]:
    """Write into `examples[i][name]` the rows of example i's keys (one lookup for the batch);
    returns (ids sent, ids the map does not know)."""
    flat = [k for v in keys if v is not None for k in ([v] if isinstance(v, str) else v)]
    rows = id_map.lookup(flat) if flat else np.zeros(0, dtype=np.int64)
    at = 0
    for example, value in zip(examples, keys, strict=True):
        if value is None:
            example[name] = None
        elif isinstance(value, str):
            example[name] = int(rows[at])
            at += 1
        else:
            example[name] = rows[at : at + len(value)].tolist()
            at += len(value)
    unknown = 0 if id_map.hashed else int(np.count_nonzero(rows == UNKNOWN_ROW))
    return len(flat), unknown
