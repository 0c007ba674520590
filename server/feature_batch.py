"""Turn a predict request's examples into the model's input tensors, checking every value, and
check the scores the model gives them.

Each example maps every feature of the model config to a value:

- a dense feature: a finite number (JSON int or float);
- a single-valued sparse feature (`bag: false`): one integer id;
- a bag feature (`bag: true`): a list of integer ids (possibly empty: the bag embeds to zeros).

Ids must lie in `[0, rows)` of the feature's table, unless the config declares `hashing`, in
which case any int64 is folded in by modulo. Every problem found is reported (up to a cap), each
with its location `["body", "examples", i, feature]` (server/feature_problems.py), so a client
sees all its mistakes in one 422. (A model trained from raw events takes raw ids instead:
server/raw_ids.py.)

This is the only check of what an example holds (the request model leaves its items to it), so the
work stays bounded by the body size: names are looked up, and messages built only for the
problems reported. An 830 KB example of 90k unknown names took 0.30 s of CPU (39 features) when
a message listing every feature was built for each name; 0.004 s now.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from publisher.dlrm import DLRMConfig, SparseBatch
from server.feature_problems import Problems

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class FeatureBatch:
    """Model input for a batch: dense (B, n_dense) float32 and one SparseBatch per feature."""

    dense: torch.Tensor
    sparse: dict[str, SparseBatch]

    @property
    def size(self) -> int:
        return int(self.dense.shape[0])


def _is_int(value: object) -> bool:
    # bool is an int subclass in Python, but `true` is not an id.
    return isinstance(value, int) and not isinstance(value, bool)


def build_batch(
    examples: Sequence[object],
    config: DLRMConfig,
    *,
    max_ids_per_bag: int = 4096,
) -> FeatureBatch:
    """Validate `examples` (as the client sent them) against `config` and build the model's
    input tensors.

    Raises FeatureValidationError listing every invalid, unknown or missing feature.
    """
    problems = Problems()
    known = {*config.dense, *(f.name for f in config.sparse)}
    checked: list[Mapping[str, object]] = []
    for i, example in enumerate(examples):
        if isinstance(example, Mapping):
            problems.check_names(i, example, known, required=known)
            checked.append(example)
        else:
            problems.add(
                i,
                None,
                f"an example is an object of feature values, got {type(example).__name__}",
                "wrong_type",
            )
            checked.append({})  # nothing more to say about it

    n = len(checked)
    dense = np.zeros((n, len(config.dense)), dtype=np.float32)
    for j, name in enumerate(config.dense):
        for i, example in enumerate(checked):
            if name not in example:
                continue  # reported as missing
            value = example[name]  # null is a wrong type, not a 0
            if isinstance(value, bool) or not isinstance(value, int | float):
                problems.add(
                    i,
                    name,
                    f"dense feature {name!r} needs a number, got {type(value).__name__}",
                    "wrong_type",
                )
            elif isinstance(value, float) and not math.isfinite(value):
                problems.add(
                    i, name, f"dense feature {name!r} must be finite, got {value}", "not_finite"
                )
            elif abs(value) > 3.0e38:
                problems.add(
                    i, name, f"dense feature {name!r} is outside float32 range", "out_of_range"
                )
            else:
                dense[i, j] = value

    sparse: dict[str, SparseBatch] = {}
    for feature in config.sparse:
        name = feature.name
        lengths = np.zeros(n, dtype=np.int64)
        flat: list[int] = []
        for i, example in enumerate(checked):
            if name not in example:
                continue  # reported as missing
            value = example[name]  # null is a wrong type, not an empty bag
            if feature.bag:
                if not isinstance(value, list):
                    problems.add(
                        i,
                        name,
                        f"bag feature {name!r} needs a list of integer ids, "
                        f"got {type(value).__name__}",
                        "wrong_type",
                    )
                    continue
                if len(value) > max_ids_per_bag:
                    problems.add(
                        i,
                        name,
                        f"bag feature {name!r} has {len(value)} ids; at most {max_ids_per_bag}",
                        "too_many_ids",
                    )
                    continue
                ids = value
            else:
                if not _is_int(value):
                    problems.add(
                        i,
                        name,
                        f"sparse feature {name!r} needs one integer id, got {type(value).__name__}",
                        "wrong_type",
                    )
                    continue
                ids = [value]
            bad = [v for v in ids if not _is_int(v)]
            if bad:
                problems.add(
                    i,
                    name,
                    f"ids of {name!r} must be integers, got {type(bad[0]).__name__}",
                    "wrong_type",
                )
                continue
            if config.hashing:
                if any(v < _INT64_MIN or v > _INT64_MAX for v in ids):
                    problems.add(i, name, f"ids of {name!r} must fit in int64", "out_of_range")
                    continue
            else:
                outside = [v for v in ids if v < 0 or v >= feature.rows]
                if outside:
                    problems.add(
                        i,
                        name,
                        f"id {outside[0]} of {name!r} is outside its table [0, {feature.rows})",
                        "id_out_of_range",
                    )
                    continue
            lengths[i] = len(ids)
            flat.extend(ids)
        if problems.items:
            continue  # nothing will be built; keep collecting problems
        values = (
            torch.tensor(flat, dtype=torch.int64) if flat else torch.zeros(0, dtype=torch.int64)
        )
        if config.hashing:
            values = torch.remainder(values, feature.rows)  # non-negative for rows > 0
        offsets = np.zeros(n, dtype=np.int64)
        if n > 1:
            np.cumsum(lengths[:-1], out=offsets[1:])
        sparse[name] = SparseBatch(values=values, offsets=torch.from_numpy(offsets))

    problems.raise_if_any()
    return FeatureBatch(dense=torch.from_numpy(dense), sparse=sparse)


def check_scores(scores: torch.Tensor, version: int) -> None:
    """FeatureValidationError naming every example whose score is not finite.

    Served weights are finite (a version holding NaN or Inf is rejected), so a NaN score comes
    from an example whose values overflow the model's float32 arithmetic (a dense value near
    3e38 gives inf - inf). JSON has no NaN: answering `null` would pass for a score, so the
    request is refused like any other it cannot score.
    """
    bad = torch.nonzero(~torch.isfinite(scores)).flatten().tolist()
    if not bad:
        return
    problems = Problems()
    for i in bad[: problems.room()]:
        problems.add(
            i,
            None,
            f"version {version} gives no finite score for this example: its values overflow "
            "the model's float32 arithmetic",
            "score_not_finite",
        )
    problems.add_unreported(len(bad) - len(problems.items))
    problems.raise_if_any()
