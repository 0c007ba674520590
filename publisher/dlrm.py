"""The DLRM-style model, rebuilt from the `model_config` a manifest carries.

Both the trainer (which trains it) and the server (which rebuilds it from a manifest) use this
module, so it lives below both of them. The config is plain JSON:

    {"architecture": "dlrm", "embedding_dim": 16,
     "sparse": [{"name": "user", "rows": 6041, "bag": false}, {"name": "genres", "rows": 19,
                "bag": true}],
     "dense": ["hour_sin", "hour_cos"], "bottom_mlp": [64], "top_mlp": [64, 32],
     "hashing": false}

Architecture (Naumov et al. 2019): a bottom MLP maps the dense features to `embedding_dim`; one
`nn.EmbeddingBag` (sum, sparse gradients) per sparse feature; the pairwise dot products of those
vectors, concatenated with the bottom output, go through the top MLP to one logit.
Table names in manifests are the module names, `embeddings.<feature>`.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from publisher.live_features import live_spec_of
from schemas.errors import BadDataError

TABLE_PREFIX = "embeddings."
_FLOAT32_BYTES = 4
_INT64_BYTES = 8


class ArchitectureError(BadDataError, ValueError):
    """A model config that does not describe a model this module can build."""


@dataclass(frozen=True)
class SparseFeature:
    """One categorical feature and its embedding table."""

    name: str
    rows: int
    bag: bool = False  # multi-hot: several ids per example, summed


@dataclass(frozen=True)
class DLRMConfig:
    """Everything needed to rebuild the architecture (not the weights)."""

    sparse: tuple[SparseFeature, ...]
    dense: tuple[str, ...]
    embedding_dim: int = 16
    bottom_mlp: tuple[int, ...] = (64,)
    top_mlp: tuple[int, ...] = (64, 32)
    #: ids outside a table are folded in by modulo instead of refused.
    hashing: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The manifest's `model_config`."""
        return {
            "architecture": "dlrm",
            "embedding_dim": self.embedding_dim,
            "sparse": [{"name": f.name, "rows": f.rows, "bag": f.bag} for f in self.sparse],
            "dense": list(self.dense),
            "bottom_mlp": list(self.bottom_mlp),
            "top_mlp": list(self.top_mlp),
            "hashing": self.hashing,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, config: Mapping[str, Any]) -> DLRMConfig:
        """Parse a manifest's `model_config`; ArchitectureError names what is wrong."""
        if config.get("architecture") != "dlrm":
            raise ArchitectureError(
                f"model_config architecture is {config.get('architecture')!r}, expected 'dlrm'"
            )
        try:
            sparse = tuple(
                SparseFeature(str(f["name"]), int(f["rows"]), bool(f.get("bag", False)))
                for f in config["sparse"]
            )
            parsed = cls(
                sparse=sparse,
                dense=tuple(str(d) for d in config["dense"]),
                embedding_dim=int(config["embedding_dim"]),
                bottom_mlp=tuple(int(x) for x in config["bottom_mlp"]),
                top_mlp=tuple(int(x) for x in config["top_mlp"]),
                hashing=bool(config.get("hashing", False)),
                extra=dict(config.get("extra", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ArchitectureError(f"invalid dlrm model_config: {exc!r}") from exc
        parsed.validate()
        return parsed

    def validate(self) -> None:
        names = [f.name for f in self.sparse]
        if not names or len(set(names)) != len(names):
            raise ArchitectureError(f"sparse feature names must be unique and non-empty: {names}")
        if any(f.rows < 1 or f.rows > 2**31 for f in self.sparse):
            raise ArchitectureError("every table needs 1 .. 2**31 rows")
        if not 1 <= self.embedding_dim <= 4096:
            raise ArchitectureError(f"embedding_dim {self.embedding_dim} out of 1..4096")
        if any(w < 1 for w in (*self.bottom_mlp, *self.top_mlp)):
            raise ArchitectureError("MLP widths must be >= 1")

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors `DLRM(self)` allocates, from the config alone (nothing built):
        float32 embedding tables and MLP weights and biases, and the int64 indices of the
        feature pairs (counted twice: `triu_indices` and their contiguous copies coexist). The
        pairs grow with the square of the table count, which dominates the few KiB of Python
        objects each table also costs."""
        d = self.embedding_dim
        n = len(self.sparse) + 1
        n_pairs = n * (n - 1) // 2
        bottom = [max(len(self.dense), 1), *self.bottom_mlp, d]
        top = [d + n_pairs, *self.top_mlp, 1]
        mlp_values = sum(
            a * b + b for layers in (bottom, top) for a, b in itertools.pairwise(layers)
        )
        tables_values = sum(f.rows for f in self.sparse) * d
        return _FLOAT32_BYTES * (tables_values + mlp_values) + 2 * 2 * _INT64_BYTES * n_pairs

    @property
    def table_names(self) -> dict[str, str]:
        """Feature name -> table (module) name."""
        return {f.name: TABLE_PREFIX + f.name for f in self.sparse}


def _mlp(sizes: Sequence[int], final_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2 or final_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


@dataclass(frozen=True)
class SparseBatch:
    """Ids of one sparse feature for a batch: flat `values`, and `offsets` where each bag starts."""

    values: torch.Tensor  # int64 (nnz,)
    offsets: torch.Tensor  # int64 (batch,)


class DLRM(nn.Module):
    """Bottom MLP, embedding bags, dot interaction, top MLP; returns logits (batch,)."""

    def __init__(self, config: DLRMConfig, *, draw_tables: bool = True) -> None:
        """`draw_tables=False` allocates the tables without drawing their rows, for a model
        every row of which is written before use (a server writes a full version first): the
        pages of a table stay unwritten, so a table that is then replaced (a server holding it
        quantized) never becomes resident, and the others are written once, not three times."""
        super().__init__()
        config.validate()
        self.config = config
        d = config.embedding_dim
        self.bottom = bottom_mlp(config)
        self.embeddings = nn.ModuleDict(
            {
                f.name: nn.EmbeddingBag(f.rows, d, mode="sum", sparse=True)
                if draw_tables
                # A weight given at construction is not reset (drawn from N(0, 1)).
                else nn.EmbeddingBag(
                    f.rows, d, mode="sum", sparse=True, _weight=torch.empty(f.rows, d)
                )
                for f in config.sparse
            }
        )
        self.top = top_mlp(config)
        self.pair_rows, self.pair_cols = feature_pairs(len(config.sparse) + 1)
        if draw_tables:
            self._init_weights()

    def _init_weights(self) -> None:
        for emb in self.embeddings.values():
            assert isinstance(emb, nn.EmbeddingBag)
            init_embedding_rows(emb.weight)

    def forward(self, dense: torch.Tensor, sparse: Mapping[str, SparseBatch]) -> torch.Tensor:
        x = self.bottom(bottom_input(dense))
        pooled = [
            emb(sparse[name].values, sparse[name].offsets) for name, emb in self.embeddings.items()
        ]
        top_in = dot_interaction(x, pooled, self.pair_rows, self.pair_cols)
        logits: torch.Tensor = self.top(top_in).squeeze(1)
        return logits


# The dense parts below are shared with the sharded trainer's model (trainer/sharded/model.py),
# so the two compute the same function and a sharded job's dense blob loads into a DLRM.


def bottom_mlp(config: DLRMConfig) -> nn.Sequential:
    """The bottom MLP: dense features -> `embedding_dim` (ReLU after every layer)."""
    sizes = [max(len(config.dense), 1), *config.bottom_mlp, config.embedding_dim]
    return _mlp(sizes, final_relu=True)


def top_mlp(config: DLRMConfig) -> nn.Sequential:
    """The top MLP: the bottom output and the pairwise dot products -> one logit."""
    n = len(config.sparse) + 1
    return _mlp([config.embedding_dim + n * (n - 1) // 2, *config.top_mlp, 1], final_relu=False)


def bottom_input(dense: torch.Tensor) -> torch.Tensor:
    """The bottom MLP's input: the dense features, or one zero column when there are none."""
    if dense.shape[1] == 0:
        return torch.zeros(dense.shape[0], 1, dtype=dense.dtype, device=dense.device)
    return dense


def feature_pairs(n: int, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Which (i, j) cells of the n x n dot-product matrix are distinct pairs (i < j)."""
    rows, cols = torch.triu_indices(n, n, 1, device=device)
    return rows.contiguous(), cols.contiguous()


def dot_interaction(
    x: torch.Tensor,
    pooled: Sequence[torch.Tensor],
    pair_rows: torch.Tensor,
    pair_cols: torch.Tensor,
) -> torch.Tensor:
    """The top MLP's input (B, dim + pairs): the bottom output x (B, dim), then the dot
    products of the distinct pairs of [x, *pooled] (`feature_pairs`)."""
    stacked = torch.stack([x, *pooled], dim=1)  # (B, n, d)
    dots = torch.bmm(stacked, stacked.transpose(1, 2))
    return torch.cat([x, dots[:, pair_rows, pair_cols]], dim=1)


@torch.no_grad()
def init_embedding_rows(
    weight: torch.Tensor,
    rows: torch.Tensor | None = None,
    *,
    generator: torch.Generator | None = None,
) -> None:
    """Draw `rows` (all when None) of an embedding table from its initial distribution,
    uniform in +-1/sqrt(dim): at construction, and for a row whose id was evicted (a live id
    space reuses it for another id, which must not inherit its values). `generator`: draw
    from it instead of torch's global generator."""
    bound = 1.0 / int(weight.shape[1]) ** 0.5
    if rows is None:
        nn.init.uniform_(weight, -bound, bound, generator=generator)
        return
    fresh = torch.empty(len(rows), weight.shape[1], dtype=weight.dtype, device=weight.device)
    weight.index_copy_(0, rows, fresh.uniform_(-bound, bound, generator=generator))


def build_model(model_config: Mapping[str, Any]) -> DLRM:
    """The architecture a manifest's `model_config` describes (weights uninitialised for use)."""
    return DLRM(DLRMConfig.from_json(model_config))


def build_served_model(model_config: Mapping[str, Any]) -> DLRM:
    """The model factory of `checknrun serve` (and `ModuleSink`) for the built-in DLRM: the
    model `model_config` describes, its live spec checked (a model trained from raw events),
    its tables allocated but not drawn: a full version writes every row before a reader sees
    it, and a table then held quantized never has its float32 pages written at all."""
    if model_config.get("architecture") != "dlrm":
        raise ArchitectureError(
            f"model_config architecture is {model_config.get('architecture')!r}, not the "
            "built-in 'dlrm': serve a model of your own with a model factory "
            "(`checknrun serve --model-factory MODULE:FUNCTION`, docs/SERVER.md)"
        )
    config = DLRMConfig.from_json(model_config)
    live_spec_of(config)
    return DLRM(config, draw_tables=False)


def served_model_bytes(model_config: Mapping[str, Any]) -> int:
    """What `build_served_model(model_config)` allocates, from the config alone
    (`DLRMConfig.nbytes`): the memory budget's size of a DLRM, no module built."""
    return DLRMConfig.from_json(model_config).nbytes


def table_weight_names(model: DLRM) -> dict[str, str]:
    """Table (module) name -> its state_dict key."""
    return {TABLE_PREFIX + name: f"{TABLE_PREFIX}{name}.weight" for name in model.embeddings}
