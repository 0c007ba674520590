"""What a live model's inputs are, computed the same way by the trainer and by every server.

A model trained from raw events (`checknrun train --data kafka://...`) carries this spec in its
`model_config.extra["live"]`:

    {"id_space": "dynamic", "features": [{"name": "user", "bag": false}, ...],
     "count_features": ["user", "item"], "time_features": true, "rating_threshold": 4.0}

Its sparse inputs are the events' raw ids mapped through each table's id map
(publisher/id_map.py). Its dense inputs are derived, never sent: from the event time (or the
request time), hour-of-day and day-of-week as sin/cos; for each count feature,
`log1p(prior count) / 5`, the prior count being the events the id map has counted for the id
before this one (0 for an id without a row). A client therefore sends only raw ids and,
optionally, a timestamp (docs/FORMAT.md section 8).
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
class LiveSpec:
    """The inputs of a model trained from raw events (see the module docstring)."""

    features: tuple[LiveFeature, ...]
    id_space: str = "dynamic"
    count_features: tuple[str, ...] = ()
    time_features: bool = True
    rating_threshold: float = 4.0

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

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.features)

    @property
    def dense_names(self) -> tuple[str, ...]:
        """The model's dense inputs, in order."""
        times = TIME_FEATURES if self.time_features else ()
        return (*times, *(f"{name}_prior_log" for name in self.count_features))

    def dense(
        self, ts: npt.NDArray[np.float64], prior_counts: Mapping[str, npt.NDArray[np.int64]]
    ) -> npt.NDArray[np.float32]:
        """The dense inputs of n examples: `ts` (n,) unix seconds, `prior_counts[name]` (n,)
        for every count feature."""
        columns: list[npt.NDArray[np.float64]] = []
        if self.time_features:
            times = time_features(np.asarray(ts, dtype=np.float64))
            columns += [times[name] for name in TIME_FEATURES]
        for name in self.count_features:
            counts = np.asarray(prior_counts[name], dtype=np.float64)
            columns.append(np.log1p(np.maximum(counts, 0.0)) / PRIOR_LOG_SCALE)
        if not columns:
            return np.zeros((len(ts), 0), dtype=np.float32)
        return np.stack(columns, axis=1).astype(np.float32)

    def to_json(self) -> dict[str, Any]:
        return {
            "id_space": self.id_space,
            "features": [{"name": f.name, "bag": f.bag} for f in self.features],
            "count_features": list(self.count_features),
            "time_features": self.time_features,
            "rating_threshold": self.rating_threshold,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LiveSpec:
        """Parse `model_config.extra["live"]`; LiveSpecError names what is wrong."""
        try:
            features = tuple(
                LiveFeature(str(f["name"]), bool(f.get("bag", False))) for f in data["features"]
            )
            return cls(
                features=features,
                id_space=str(data.get("id_space", "dynamic")),
                count_features=tuple(str(n) for n in data.get("count_features", ())),
                time_features=bool(data.get("time_features", True)),
                rating_threshold=float(data.get("rating_threshold", 4.0)),
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
    its inputs: one table per feature with the same bag flag, the derived dense inputs in order,
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
            f"the model's dense inputs {list(config.dense)} are not the live spec's derived "
            f"inputs {list(spec.dense_names)}"
        )
    if spec.id_space == "dynamic" and any(f.rows < 2 for f in config.sparse):
        raise LiveSpecError("a dynamic id space needs at least 2 rows per table")
    return spec


def new_id_maps(config: DLRMConfig, spec: LiveSpec) -> dict[str, IdMap]:
    """Empty id maps of a DLRM `config`'s tables, by table name."""
    hashed = spec.id_space == "hash"
    tables = config.table_names
    return {tables[f.name]: IdMap(f.rows, hashed=hashed) for f in config.sparse}
