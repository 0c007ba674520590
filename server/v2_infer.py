"""What a v2 infer request does, over REST (server/routes/v2.py) and gRPC (server/grpc_v2/):
named tensors into the predictor's examples, scored against one version.

    outcome = infer(state, "ranker", None, tensors)   # V2Error subclasses say what went wrong
    outcome.scores, outcome.version, outcome.parameters

The tensor mapping (docs/SERVER.md, "The v2 protocol"): one tensor per feature; a single-valued
one `[B]` or `[B, 1]`, a bag its ids flat plus `<feature>_lengths`; BYTES are UTF-8 text ("" is
no id), NaN is a missing number. The examples go through the app's predictor, as /v1/predict's
do, so a v2 answer is the v1 answer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from publisher.read import ModelCopy, NotBootstrappedError
from server.dependencies import ServerState
from server.feature_problems import FeatureValidationError
from server.predictors import Predictor
from server.v2_tensors import (
    BYTES,
    BatchTooLargeError,
    V2NotFoundError,
    V2RequestError,
    V2UnavailableError,
)

#: the suffix of a bag's lengths tensor.
LENGTHS = "_lengths"
SCORE = "score"


@dataclass(frozen=True)
class InferOutcome:
    """The scores of a request, the version that gave them, the response's parameters (the
    server's `track`, and `unknown_ids_<feature>` counts)."""

    scores: npt.NDArray[np.float32]
    version: int
    parameters: dict[str, int | str]


def check_model(state: ServerState, name: str) -> None:
    """V2NotFoundError unless `name` is the model this server serves."""
    if name != state.settings.model:
        raise V2NotFoundError(
            f"unknown model {name!r}; this server serves {state.settings.model!r}"
        )


def max_elements(state: ServerState) -> int:
    """The most elements one input tensor may hold: a full batch of full bags."""
    settings = state.settings
    return settings.max_batch * max(1, settings.max_ids_per_bag)


def infer(
    state: ServerState, name: str, version: int | None, tensors: Mapping[str, np.ndarray]
) -> InferOutcome:
    """Score `tensors` against the served version (`version`: that one only); V2Error
    subclasses for what is wrong."""
    check_model(state, name)
    live = state.live
    if live is None or live.version is None:
        raise V2UnavailableError("no version is served yet")
    if version is not None and live.version != version:
        raise _not_served(version, live.version)
    started = time.perf_counter()
    try:
        # columns straight into the model's batch where the predictor can (the DLRM of encoded
        # ids: server/feature_columns.py), else through the examples /v1 takes
        got = state.predictor.predict_columns(
            live.sink, tensors, time.time(), max_batch=state.settings.max_batch
        )
        if got is None:
            examples = tensor_examples(tensors, state.settings.max_batch)
            got = state.predictor.predict(live.sink, examples, time.time())
        scored, served = got
    except FeatureValidationError as exc:
        raise V2RequestError(_problems_text(exc)) from exc
    except NotBootstrappedError as exc:
        raise V2UnavailableError(str(exc)) from exc
    if version is not None and served.version != version:  # swapped meanwhile: not that one's
        raise _not_served(version, served.version)
    scores = scored.scores.numpy().astype(np.float32)
    metrics = state.metrics
    metrics.predict_seconds.observe(time.perf_counter() - started)
    metrics.predict_examples.inc(len(scores))
    parameters: dict[str, int | str] = {"track": state.settings.track}
    parameters.update({f"unknown_ids_{k}": v for k, v in (scored.unknown_ids or {}).items()})
    return InferOutcome(scores, served.version, parameters)


def check_outputs(asked: Mapping[str, Any] | None) -> None:
    """V2RequestError if a request asks for an output the model does not have."""
    if asked is not None and set(asked) - {SCORE}:
        unknown = sorted(set(asked) - {SCORE})
        raise V2RequestError(f"unknown outputs {unknown[:8]}; the model's output is {SCORE!r}")


def model_metadata(state: ServerState, name: str) -> dict[str, Any]:
    """The v2 model metadata of the served version."""
    check_model(state, name)
    live = state.live
    copy = None if live is None else live.sink.current()
    if copy is None or copy.served is None:
        raise V2UnavailableError("no version is served yet")
    return {
        "name": name,
        "versions": [str(copy.served.version)],
        "platform": "checknrun",
        "inputs": input_metadata(state.predictor, copy),
        "outputs": [{"name": SCORE, "datatype": "FP32", "shape": [-1]}],
    }


def input_metadata(predictor: Predictor, copy: ModelCopy) -> list[dict[str, Any]]:
    """The model's inputs as v2 tensors (the module docstring's mapping). A model of your own
    lists its adapter's id features (raw ids, BYTES); its other inputs' types are the adapter's
    to know, so they are left out (`GET /v1/model` names them)."""
    space = predictor.id_space(copy)
    raw = space is not None
    out: list[dict[str, Any]] = []
    for feature in predictor.features(copy):
        if feature.kind in ("derived", "input"):
            continue
        if feature.kind == "raw_id":
            out.append({"name": feature.name, "datatype": BYTES, "shape": [-1]})
            continue
        if feature.kind == "dense":
            out.append({"name": feature.name, "datatype": "FP32", "shape": [-1]})
            continue
        out.append({"name": feature.name, "datatype": BYTES if raw else "INT64", "shape": [-1]})
        if feature.kind == "bag":
            out.append({"name": feature.name + LENGTHS, "datatype": "INT64", "shape": [-1]})
    if space is not None and space.time_features:  # the event time the time inputs read
        out.append({"name": "ts", "datatype": "FP64", "shape": [-1]})
    return out


def is_ready(state: ServerState) -> bool:
    live = state.live
    return live is not None and live.version is not None


def tensor_examples(tensors: Mapping[str, np.ndarray], max_batch: int) -> list[dict[str, Any]]:
    """The examples the named tensors hold (the module docstring's mapping): one value per
    example of a single tensor, a list per example of a bag (its ids split by its lengths)."""
    bags = {
        n[: -len(LENGTHS)] for n in tensors if n.endswith(LENGTHS) and n[: -len(LENGTHS)] in tensors
    }
    batch: int | None = None
    columns: dict[str, list[Any]] = {}
    for name, array in tensors.items():
        if name.endswith(LENGTHS) and name[: -len(LENGTHS)] in bags:
            continue
        if name in bags:
            column = _bag(name, array, tensors[name + LENGTHS])
        else:
            if not (array.ndim == 1 or (array.ndim == 2 and array.shape[1] == 1)):
                raise V2RequestError(
                    f"input {name!r}: shape {list(array.shape)} is not one value per example "
                    f"([batch] or [batch, 1]); a bag sends {name + LENGTHS!r} beside its ids"
                )
            column = _values(array.reshape(-1), name)
        if batch is None:
            batch = len(column)
        elif len(column) != batch:
            raise V2RequestError(f"input {name!r} has {len(column)} examples, another {batch}")
        columns[name] = column
    if batch is None:
        raise V2RequestError("the request has no input")
    if batch > max_batch:
        raise BatchTooLargeError(f"batch of {batch} examples exceeds the cap of {max_batch}")
    names = list(columns)
    return [{n: v for n in names if (v := columns[n][i]) is not None} for i in range(batch)]


def _bag(name: str, ids: np.ndarray, lengths: np.ndarray) -> list[Any]:
    """Each example's ids of a bag: `ids` flat, split by `lengths`."""
    if lengths.dtype.kind not in "iu" or lengths.ndim != 1:
        raise V2RequestError(f"input {name + LENGTHS!r} is one integer length per example")
    counts = lengths.astype(np.int64)
    if counts.size and int(counts.min()) < 0:
        raise V2RequestError(f"input {name + LENGTHS!r}: a length is negative")
    flat = ids.reshape(-1)
    if int(counts.sum()) != flat.size:
        raise V2RequestError(
            f"input {name!r}: its lengths add up to {int(counts.sum())}, it holds {flat.size} ids"
        )
    values = _values(flat, name)
    ends = np.cumsum(counts).tolist()
    starts = [0, *ends[:-1]]
    return [[v for v in values[a:b] if v is not None] for a, b in zip(starts, ends, strict=True)]


def _values(array: np.ndarray, name: str) -> list[Any]:
    """Python values of a flat array: BYTES as UTF-8 text ("" is none), NaN as none."""
    if array.dtype == object:
        try:
            return [v.decode("utf-8") or None for v in array.tolist()]
        except UnicodeDecodeError as exc:
            raise V2RequestError(f"input {name!r}: an element is not UTF-8 ({exc})") from exc
    values: list[Any] = array.tolist()
    if array.dtype.kind == "f":
        return [None if math.isnan(v) else v for v in values]
    return values


def _not_served(version: int, served: int | None) -> V2NotFoundError:
    now = "no version yet" if served is None else f"version {served}"
    return V2NotFoundError(f"version {version} is not served; this server serves {now}")


def _problems_text(exc: FeatureValidationError) -> str:
    shown = "; ".join(
        f"{p.feature or 'example'}"
        + (f"[{p.example}]" if p.example is not None else "")
        + f": {p.message}"
        for p in exc.problems[:8]
    )
    more = len(exc.problems) - 8
    return shown + (f"; ... and {more} more" if more > 0 else "")
