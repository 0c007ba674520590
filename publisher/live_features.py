"""What a live model's inputs are, computed the same way by the trainer and by every server.

A model trained from raw events (`checknrun train --data kafka://...`) carries this spec in its
`model_config.extra["live"]`:

    {"id_space": "dynamic", "features": [{"name": "user", "bag": false}, ...],
     "count_features": ["user", "item"], "time_features": true, "rating_threshold": 4.0,
     "dense_features": [{"name": "price", "transform": "log1p"}]}

Its sparse inputs are the events' raw ids mapped through each table's id map
(publisher/id_map.py). Its dense inputs (docs/FORMAT.md section 8.4) are, in order: from the
event time (or the request time), hour-of-day and day-of-week as sin/cos; for each count
feature, `log1p(prior count) / 5`, the prior count being the events the id map has counted for
the id before this one (0 for an id without a row); for each dense feature, the number the event
(or the request) sends, transformed (`log1p`: sign(x) * log1p(|x|), or `raw`) and clipped to
[-DENSE_CLIP, DENSE_CLIP], and a missing indicator (1.0 when absent or null, the value then 0.0).
A client therefore sends raw ids, its dense values and, optionally, a timestamp.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from publisher.id_map import ID_SPACES, IdMap
from schemas.errors import BadDataError

if TYPE_CHECKING:
    from publisher.dlrm import DLRMConfig

TIME_FEATURES = ("hour_sin", "hour_cos", "dow_sin", "dow_cos")
#: scale of the prior-count features (log1p(count) / 5 is ~1 at 150 events).
PRIOR_LOG_SCALE = 5.0
#: names an event uses for itself; no feature may take them.
RESERVED_NAMES = ("ts", "label", "rating", "event_id")
#: how a dense feature's value becomes a model input (docs/FORMAT.md section 8.4).
DENSE_TRANSFORMS = ("log1p", "raw")
#: a transformed dense value is clipped to [-DENSE_CLIP, DENSE_CLIP]: one hostile number cannot
#: blow up a step (real values reach it only past e^100 under log1p).
DENSE_CLIP = 100.0


class LiveSpecError(BadDataError, ValueError):
    """A live feature spec that cannot describe a model; the message says why."""


def time_features(seconds: npt.NDArray[np.float64]) -> dict[str, npt.NDArray[np.float64]]:
    """Hour-of-day and day-of-week as sin/cos pairs, from unix seconds (UTC)."""
    day = 86_400.0
    hour_angle = 2 * np.pi * (np.mod(seconds, day) / day)
    week_angle = 2 * np.pi * (np.mod(seconds / day + 3.0, 7.0) / 7.0)  # 1970-01-01 was Thursday
    return {
        "hour_sin": np.sin(hour_angle),
        "hour_cos": np.cos(hour_angle),
        "dow_sin": np.sin(week_angle),
        "dow_cos": np.cos(week_angle),
    }


@dataclass(frozen=True)
class LiveFeature:
    name: str
    bag: bool = False


@dataclass(frozen=True)
class DenseFeature:
    """A numeric field of the events and how it becomes a model input."""

    name: str
    transform: str = "log1p"

    @property
    def input_names(self) -> tuple[str, str]:
        """The model's two dense inputs for it: the transformed value, the missing flag."""
        return f"{self.name}_{self.transform}", f"{self.name}_missing"

    def inputs(self, values: npt.NDArray[np.float64]) -> list[npt.NDArray[np.float64]]:
        """The two input columns of `values` (n,), NaN where the value is missing."""
        missing = np.isnan(values)
        present = np.where(missing, 0.0, values)
        if self.transform == "log1p":
            present = np.sign(present) * np.log1p(np.abs(present))
        return [np.clip(present, -DENSE_CLIP, DENSE_CLIP), missing.astype(np.float64)]


@dataclass(frozen=True)
class LiveSpec:
    """The inputs of a model trained from raw events (see the module docstring)."""

    features: tuple[LiveFeature, ...]
    id_space: str = "dynamic"
    count_features: tuple[str, ...] = ()
    time_features: bool = True
    rating_threshold: float = 4.0
    dense_features: tuple[DenseFeature, ...] = ()

    def __post_init__(self) -> None:
        names = [f.name for f in self.features]
        if not names or len(set(names)) != len(names):
            raise LiveSpecError(f"live feature names must be unique and non-empty: {names}")
        for name in names:
            if name in RESERVED_NAMES or not name.isidentifier():
                raise LiveSpecError(
                    f"feature name {name!r} must be an identifier other than {RESERVED_NAMES}"
                )
        if self.id_space not in ID_SPACES:
            raise LiveSpecError(f"id_space {self.id_space!r} is not one of {ID_SPACES}")
        singles = {f.name for f in self.features if not f.bag}
        for name in self.count_features:
            if name not in singles:
                raise LiveSpecError(f"count feature {name!r} is not a single-valued feature")
        dense = [d.name for d in self.dense_features]
        if len(set(dense)) != len(dense) or set(dense) & set(names):
            raise LiveSpecError(
                f"dense feature names must be unique and differ from the features: {dense}"
            )
        for feature in self.dense_features:
            if feature.name in RESERVED_NAMES or not feature.name.isidentifier():
                raise LiveSpecError(
                    f"dense feature name {feature.name!r} must be an identifier other than "
                    f"{RESERVED_NAMES}"
                )
            if feature.transform not in DENSE_TRANSFORMS:
                raise LiveSpecError(
                    f"dense feature {feature.name!r}: transform {feature.transform!r} is not one "
                    f"of {DENSE_TRANSFORMS}"
                )

    @staticmethod
    def parse_features(text: str) -> tuple[LiveFeature, ...]:
        """`user,item,genres[]` -> features (a trailing `[]` marks a bag)."""
        out = []
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            bag = part.endswith("[]")
            out.append(LiveFeature(part[:-2] if bag else part, bag))
        return tuple(out)

    @staticmethod
    def parse_dense_features(text: str) -> tuple[DenseFeature, ...]:
        """`price,clicks:raw` -> dense features (`:TRANSFORM`, default log1p)."""
        out = []
        for part in (p.strip() for p in text.split(",")):
            if part:
                name, _, transform = part.partition(":")
                out.append(DenseFeature(name.strip(), transform.strip() or "log1p"))
        return tuple(out)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.features)

    @property
    def dense_feature_names(self) -> tuple[str, ...]:
        """The events' numeric fields, in order."""
        return tuple(d.name for d in self.dense_features)

    @property
    def dense_names(self) -> tuple[str, ...]:
        """The model's dense inputs, in order."""
        times = TIME_FEATURES if self.time_features else ()
        given = (name for d in self.dense_features for name in d.input_names)
        return (*times, *(f"{name}_prior_log" for name in self.count_features), *given)

    def dense(
        self,
        ts: npt.NDArray[np.float64],
        prior_counts: Mapping[str, npt.NDArray[np.int64]],
        values: npt.NDArray[np.float64] | None = None,
    ) -> npt.NDArray[np.float32]:
        """The dense inputs of n examples: `ts` (n,) unix seconds, `prior_counts[name]` (n,)
        for every count feature, `values` (n, dense features) the dense features' values, NaN
        where missing (None: all missing)."""
        columns: list[npt.NDArray[np.float64]] = []
        if self.time_features:
            times = time_features(np.asarray(ts, dtype=np.float64))
            columns += [times[name] for name in TIME_FEATURES]
        for name in self.count_features:
            counts = np.asarray(prior_counts[name], dtype=np.float64)
            columns.append(np.log1p(np.maximum(counts, 0.0)) / PRIOR_LOG_SCALE)
        if self.dense_features:
            n = len(ts)
            given = (
                np.full((n, len(self.dense_features)), np.nan)
                if values is None
                else np.asarray(values, dtype=np.float64).reshape(n, len(self.dense_features))
            )
            for j, feature in enumerate(self.dense_features):
                columns += feature.inputs(given[:, j])
        if not columns:
            return np.zeros((len(ts), 0), dtype=np.float32)
        return np.stack(columns, axis=1).astype(np.float32)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id_space": self.id_space,
            "features": [{"name": f.name, "bag": f.bag} for f in self.features],
            "count_features": list(self.count_features),
            "time_features": self.time_features,
            "rating_threshold": self.rating_threshold,
        }
        if self.dense_features:  # absent otherwise: older specs and fingerprints stay as they were
            out["dense_features"] = [
                {"name": d.name, "transform": d.transform} for d in self.dense_features
            ]
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LiveSpec:
        """Parse `model_config.extra["live"]`; LiveSpecError names what is wrong."""
        try:
            features = tuple(
                LiveFeature(str(f["name"]), bool(f.get("bag", False))) for f in data["features"]
            )
            dense = tuple(
                DenseFeature(str(d["name"]), str(d.get("transform", "log1p")))
                for d in data.get("dense_features", ())
            )
            return cls(
                features=features,
                id_space=str(data.get("id_space", "dynamic")),
                count_features=tuple(str(n) for n in data.get("count_features", ())),
                time_features=bool(data.get("time_features", True)),
                rating_threshold=float(data.get("rating_threshold", 4.0)),
                dense_features=dense,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, LiveSpecError):
                raise
            raise LiveSpecError(f"invalid live feature spec: {exc!r}") from exc

    @classmethod
    def of_config(cls, extra: Mapping[str, Any]) -> LiveSpec | None:
        """The spec in a DLRM config's `extra`, or None for a model that takes encoded ids."""
        live = extra.get("live")
        return None if live is None else cls.from_json(live)


def feature_sizes(spec: LiveSpec, rows: int | Mapping[str, int]) -> Sequence[tuple[str, int, bool]]:
    """(name, table rows, bag) per feature, from one size for all or a size per feature."""
    return [
        (f.name, rows if isinstance(rows, int) else int(rows[f.name]), f.bag) for f in spec.features
    ]


def live_spec_of(config: DLRMConfig) -> LiveSpec | None:
    """The live spec of a DLRM `config` (None for a model of encoded ids), checked to describe
    its inputs: one table per feature with the same bag flag, the spec's dense inputs in order,
    and at least 2 rows per table of a dynamic id space. LiveSpecError says what disagrees."""
    spec = LiveSpec.of_config(config.extra)
    if spec is None:
        return None
    tables = {f.name: f.bag for f in config.sparse}
    features = {f.name: f.bag for f in spec.features}
    if tables != features:
        raise LiveSpecError(
            f"the live spec's features {features} are not the model's sparse features {tables}"
        )
    if tuple(config.dense) != spec.dense_names:
        raise LiveSpecError(
            f"the model's dense inputs {list(config.dense)} are not the live spec's "
            f"{list(spec.dense_names)}"
        )
    if spec.id_space == "dynamic" and any(f.rows < 2 for f in config.sparse):
        raise LiveSpecError("a dynamic id space needs at least 2 rows per table")
    return spec


def new_id_maps(config: DLRMConfig, spec: LiveSpec) -> dict[str, IdMap]:
    """Empty id maps of a DLRM `config`'s tables, by table name."""
    hashed = spec.id_space == "hash"
    tables = config.table_names
    return {tables[f.name]: IdMap(f.rows, hashed=hashed) for f in config.sparse}
