"""Request and response bodies of the REST API: input and output models are separate classes.

Inputs forbid unknown fields so a typo is a 422, not a silently ignored field. Outputs are built
by the routes from the live model; none of them carries a token, a store credential or a URL.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SkipValidation,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_validator,
)
from pydantic.config import JsonDict

from server.errors import shown_input

FeatureValue = Annotated[
    StrictInt | StrictFloat | StrictStr | list[StrictInt | StrictStr] | None,
    Field(
        description="A model of encoded ids: a dense feature a number, a single-valued sparse "
        "feature an integer id, a bag feature a list of integer ids. A model trained from raw "
        "events (GET /v1/model `id_space` not null): a single-valued feature one raw id (string "
        "or integer), a bag a list of raw ids, null or absent for none; `ts` optional unix "
        "seconds."
    ),
]

_EXAMPLE: JsonDict = {
    "examples": [
        {"user": 12, "item": 345, "genres": [1, 7], "hour_sin": 0.3, "hour_cos": -0.95},
    ]
}
_COLUMNS_EXAMPLE: JsonDict = {
    "columns": {
        "user": [12, 13],
        "item": [345, 9],
        "genres": [1, 7, 3],
        "genres_lengths": [2, 1],
        "hour_sin": [0.3, 0.1],
        "hour_cos": [-0.95, 0.99],
    }
}
_RAW_EXAMPLE: JsonDict = {
    "examples": [
        {"user": "u1", "item": 42, "genres": ["Drama", "Comedy"], "ts": 1700000000},
        {"user": "new-user", "item": 7},
    ]
}


class PredictRequest(BaseModel):
    """A batch of examples to score against the served model version.

    The schema documents each example, but validating them is left to
    `server.feature_batch.build_batch`, which checks them against the served model with work
    bounded by the body and a capped report: pydantic builds an error for every bad value, and
    FastAPI a JSON entry echoing its input (210k of them, a 24 MB answer and 5.6 s of CPU for
    one 770 KB body of bad values).
    """

    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"examples": [_EXAMPLE, _COLUMNS_EXAMPLE, _RAW_EXAMPLE]}
    )

    examples: list[SkipValidation[dict[str, FeatureValue]]] | None = Field(
        default=None,
        min_length=1,
        description="A model of encoded ids (GET /v1/model `id_space` null): each example maps "
        "every feature of the model config (GET /v1/model, `features`) to a value: dense "
        "features a finite number, single-valued sparse features an integer id in [0, rows), "
        "bag features a list of such ids. Ids outside a table are a 422 unless the model "
        "declares hashing (then ids are folded in by modulo). Unknown or missing features are "
        "a 422. A model trained from raw events (`id_space` not null): each example maps its "
        "sparse and bag features to raw ids as the events carry them (a string or an integer, "
        '`42` and `"42"` being one id; a list of them for a bag; null or absent: none, read '
        "as row 0 or an empty bag) and optionally `ts`, the example's unix time (default: the "
        "request time); the dense features are derived by the server (kind `derived`), never "
        "sent; ids the served version does not know are served by row 0 and counted in "
        "`unknown_ids`; unknown names are a 422. More examples than the server's cap, or a "
        "body above its byte cap, are a 413.",
    )

    columns: SkipValidation[dict[str, list[FeatureValue]]] | None = Field(
        default=None,
        description="The columnar form, instead of `examples`: one list per input, named as "
        "the v2 protocol's tensors (docs/SERVER.md): a single-valued feature one value per "
        "example, a bag its ids flat plus `<bag>_lengths` (how many each example has). "
        "Decoded column by column into arrays, with no step per example for a model of "
        "encoded ids; the answer is the one the same examples get.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_other_fields(cls, data: object) -> object:
        # What extra="forbid" (kept for the schema) would do with one error per unknown field.
        if isinstance(data, dict):
            unknown = [k for k in data if k not in ("examples", "columns")]
            if unknown:
                names = ", ".join(f"'{shown_input(str(k))}'" for k in unknown[:5])
                more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
                raise ValueError(
                    f"unknown field(s) {names}{more}; a request holds `examples` or `columns`"
                )
            if (data.get("examples") is None) == (data.get("columns") is None):
                raise ValueError("a request holds exactly one of `examples` and `columns`")
        return data


class PredictResponse(BaseModel):
    """Scores of a batch, all computed against exactly one model version."""

    model: str = Field(description="model name")
    version: int = Field(description="the one version every score was computed with")
    track: Literal["released", "candidate"] = Field(
        description="the server's track: `released` (versions the release gate released) or "
        "`candidate` (every committed version)"
    )
    scores: list[float] = Field(description="click/like probability per example (sigmoid)")
    unknown_ids: dict[str, int] | None = Field(
        default=None,
        description="a model trained from raw events: per feature, the ids of this request "
        "the served version does not know and the examples that sent no id of a single-valued "
        "feature, each served by row 0 (the unknown row of a dynamic id space; in a hashed one "
        "only the missing ones count). Absent for a model of encoded ids.",
    )


#: how a request gives a feature (see FeatureInfo.kind).
FeatureKind = Literal["dense", "sparse", "bag", "derived", "raw_id", "input"]


class FeatureInfo(BaseModel):
    """One input feature of the served model."""

    name: str
    kind: FeatureKind = Field(
        description="`dense`: a number the request sends (for a model trained from raw events, "
        "a dense feature, absent or null: missing); `derived`: a dense input the server "
        "computes (a model trained from raw events), never sent; a model of your own "
        "(`--request-adapter`): `raw_id` a field whose raw ids the server maps with the "
        "served version's id map, `input` a field the adapter reads"
    )
    rows: int | None = Field(default=None, description="table size of a sparse/bag feature")


class IdTableInfo(BaseModel):
    """The id map of one table of a model trained from raw events, at the served version."""

    feature: str
    table: str = Field(description="the table (module) name in manifests")
    rows: int
    ids_held: int | None = Field(description="ids holding a row (null in a hashed id space)")
    capacity: int | None = Field(
        description="most ids that can hold a row at once: every row but the unknown row 0 "
        "(null in a hashed id space)"
    )


class IdSpaceInfo(BaseModel):
    """How the server maps the raw ids of a model trained from raw events."""

    mode: Literal["dynamic", "hash"] = Field(
        description="`dynamic`: a collision-free id map, unknown ids served by row 0; `hash`: "
        "blake2b-64 of the id modulo the table's rows"
    )
    unknown_row: int | None = Field(description="the row unknown ids read (null when hashed)")
    count_features: list[str] = Field(
        description="features whose prior count (from the id map) is a derived input"
    )
    time_features: bool = Field(description="hour and day-of-week of `ts` are derived inputs")
    dense_features: dict[str, str] = Field(
        default_factory=dict,
        description="numeric fields a request sends, by name, with the transform the model "
        "reads them through (`log1p` or `raw`, docs/FORMAT.md 8.4; absent or null: missing)",
    )
    tables: list[IdTableInfo]


class ServedLossInfo(BaseModel):
    """What quantization costs the served version: it and the trainer's fp32 state scored on
    the same latest samples (docs/FORMAT.md 3.2)."""

    samples: int
    auc_fp32: float
    auc_served: float
    logloss_fp32: float
    logloss_served: float
    auc_rel_loss: float = Field(
        description="(auc_fp32 - auc_served) / auc_fp32: positive when served ranks worse"
    )
    logloss_rel_increase: float = Field(
        description="(logloss_served - logloss_fp32) / logloss_fp32"
    )
    positives: int | None = Field(
        default=None, description="positive labels among the samples (null: not recorded)"
    )
    auc_loss_low: float | None = Field(
        default=None,
        description="95% paired DeLong interval of auc_fp32 - auc_served, low end: above 0 "
        "the loss is beyond the samples' noise (null: not recorded)",
    )
    auc_loss_high: float | None = Field(default=None, description="its high end")


class ApplyTimesInfo(BaseModel):
    """Where the last apply's time went on this server, stage by stage (seconds)."""

    versions: list[int] = Field(description="the versions it applied, in order")
    heard_at: datetime | None = Field(
        description="when the announcement came off the bus, or the HEAD poll that found the "
        "version began (UTC); null for a bootstrap, pin or catch-up"
    )
    plan_s: float | None = Field(description="heard -> HEAD and the manifest read")
    queue_s: float | None = Field(description="planned -> the apply began")
    fetch_s: float = Field(description="fetching, verifying and parsing the blobs")
    write_s: float = Field(description="the rest until the version served: decode, write, swap")
    level_s: float = Field(description="served -> the previous copy drained and brought level")


class ModelInfo(BaseModel):
    """The served version and how it got here."""

    model: str
    track: Literal["released", "candidate"] = Field(
        default="released",
        description="the server's track: `released` serves the versions the release gate (or a "
        "person) released, HEAD's while the model has no gate; `candidate` every committed one",
    )
    architecture: str = Field(
        description="the served version's model_config architecture (`dlrm`: the built-in "
        "model; anything else: a model of your own, built by `--model-factory`)"
    )
    version: int
    parent: int | None
    kind: Literal["full", "delta"]
    baseline: int
    applies_to: int | None
    policy: str
    trainer_step: int = Field(description="optimizer step of the trainer at this version")
    samples_seen: int
    created_at: datetime = Field(description="when the trainer committed this version (UTC)")
    applied_at: datetime = Field(description="when this server started serving it (UTC)")
    staleness_s: float = Field(
        description="seconds the oldest committed-but-unapplied version this server knows of "
        "has waited; 0 when it serves the newest it knows"
    )
    age_s: float = Field(description="seconds since the served version was created")
    latest_known_version: int | None
    versions_applied: int = Field(
        description="versions applied since start (bootstrap chain included)"
    )
    bytes_fetched: int = Field(description="blob bytes fetched and verified since start")
    rejected_versions: int = Field(
        description="versions rejected since start (failed verification, decoding or layout checks)"
    )
    pinned: bool
    pinned_version: int | None
    consistency: Literal["double-buffer", "rwlock"]
    model_memory_bytes: int = Field(description="bytes of model tensors held, every copy")
    process: int = Field(
        default=0,
        description="the request process that answered: 0 follows the versions, 1..N-1 are "
        "the other workers of `serve --workers N` (each reads the same copies)",
    )
    hashing: bool = Field(description="ids outside a table are folded in by modulo")
    features: list[FeatureInfo]
    id_space: IdSpaceInfo | None = Field(
        default=None,
        description="a model trained from raw events: how raw ids are mapped (predict takes "
        "raw ids); null for a model of encoded ids",
    )
    metrics: dict[str, float] = Field(description="online metrics the trainer recorded")
    codecs: list[str] = Field(
        default_factory=list,
        description="the codecs the served version wrote its rows with (a row it did "
        "not carry keeps the codec of the version that last wrote it)",
    )
    served_loss: ServedLossInfo | None = Field(
        default=None,
        description="the served version next to the trainer's fp32 state on the same recent "
        "samples; null when its trainer did not measure it",
    )
    last_apply: ApplyTimesInfo | None = Field(
        default=None, description="where the last apply's time went (null before one)"
    )


class PinRequest(BaseModel):
    """Serve an earlier (or any committed) version and stop following."""

    model_config = ConfigDict(extra="forbid")

    version: StrictInt = Field(ge=1, description="a committed version of the model")


class UnpinResponse(BaseModel):
    """Result of an unpin: following resumes (the server catches up in the background)."""

    was_pinned: bool
    version: int | None = Field(description="the version served at the time of the answer")


class DigestResponse(BaseModel):
    """sha256 of every tensor of the served model, to compare replicas bit for bit."""

    model: str
    version: int
    tensors: dict[str, str]


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class ReadyResponse(BaseModel):
    ready: bool
    version: int | None
    reason: str | None = None
    staleness_s: float | None = None


class ErrorResponse(BaseModel):
    """Error body of every 4xx/5xx the server itself raises."""

    detail: str | list[dict[str, object]]
