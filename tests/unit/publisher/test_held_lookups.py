"""A fused table answers the call of the module it replaces: `nn.Embedding` (any input shape)
and `nn.EmbeddingBag` (sum and mean, offsets or 2-D input, `include_last_offset`,
`per_sample_weights`), each within the bound publisher/read/held_tables.py states; modules the
kernels cannot stand in for stay float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from publisher.codecs import encode_rows
from publisher.read.held_tables import (
    SUM_ROUNDING,
    Float32Table,
    FusedTable,
    Lookup,
    held_format,
    looks_up,
    new_table,
)
from schemas.delta_blob import DeltaBlob

pytestmark = pytest.mark.skipif(
    not all(looks_up(f, 8) for f in ("int8", "int4", "int2")),
    reason="this torch lacks the quantized embedding-bag kernels",
)
ROWS, DIM = 50, 8


def held(module: nn.Module, codec: str = "int4") -> tuple[FusedTable, torch.Tensor]:
    """A fused table standing in for `module`, written with random rows, and those rows as a
    float32 table decodes them."""
    rng = np.random.default_rng(0)
    q = encode_rows(codec, rng.normal(size=(ROWS, DIM)).astype(np.float32))
    blob = DeltaBlob(
        table="t",
        codec=codec,
        dim=DIM,
        table_rows=ROWS,
        row_ids=np.arange(ROWS, dtype=np.int64),
        codes=q.codes,
        scale=q.scale,
        bias=q.bias,
        aux=np.zeros((ROWS, 0), np.float32),
    )
    table = new_table(
        ROWS, DIM, held_format(codec, DIM, lookup=Lookup.of(module)), Lookup.of(module)
    )
    assert isinstance(table, FusedTable)
    table.write_blob(blob)
    return table, table.values()


def bound(values: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor) -> float:
    """The stated bound of a bag sum's reordering, over the largest bag."""
    longest = int(torch.diff(offsets, append=torch.tensor([ids.numel()])).max())
    return (longest - 1) * SUM_ROUNDING * float(values.abs().max()) * longest + 1e-7


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 2)])
def test_an_embedding_of_any_input_shape_looks_up_exactly(shape: tuple[int, ...]) -> None:
    table, values = held(nn.Embedding(ROWS, DIM))
    ids = torch.randint(0, ROWS, shape)
    want = nn.Embedding.from_pretrained(values)(ids)
    got = table.module(ids)
    assert got.shape == (*shape, DIM)
    assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_a_bag_answers_offsets_as_its_module(mode: str, include_last_offset: bool) -> None:
    bag = nn.EmbeddingBag(ROWS, DIM, mode=mode, include_last_offset=include_last_offset)
    table, values = held(bag)
    ids = torch.randint(0, ROWS, (20,))
    offsets = torch.tensor([0, 3, 3, 10, 19])  # an empty bag among them
    if include_last_offset:
        offsets = torch.cat([offsets, torch.tensor([20])])
    reference = nn.EmbeddingBag.from_pretrained(
        values, mode=mode, include_last_offset=include_last_offset
    )
    want = reference(ids, offsets)
    got = table.module(input=ids, offsets=offsets.int())  # a KJT's offsets may be int32
    assert got.shape == want.shape
    limit = bound(values, ids, offsets[:-1] if include_last_offset else offsets)
    assert float((got - want).abs().max()) <= limit


def test_a_bag_of_2d_input_and_per_sample_weights() -> None:
    table, values = held(nn.EmbeddingBag(ROWS, DIM, mode="sum"))
    reference = nn.EmbeddingBag.from_pretrained(values, mode="sum")
    ids = torch.randint(0, ROWS, (4, 5))
    assert float((table.module(ids) - reference(ids)).abs().max()) <= 1e-5
    flat = ids.flatten()
    offsets = torch.tensor([0, 5, 10, 15])
    weights = torch.rand(flat.numel())
    got = table.module(flat, offsets, per_sample_weights=weights)
    want = reference(flat, offsets, per_sample_weights=weights)
    assert float((got - want).abs().max()) <= 1e-5


@pytest.mark.parametrize(
    "module",
    [
        nn.EmbeddingBag(ROWS, DIM, mode="max"),
        nn.EmbeddingBag(ROWS, DIM, mode="sum", padding_idx=0),
        nn.Embedding(ROWS, DIM, max_norm=1.0),
    ],
    ids=["bag max", "bag padding_idx", "embedding max_norm"],
)
def test_modules_the_kernels_cannot_stand_in_for_stay_float32(module: nn.Module) -> None:
    lookup = Lookup.of(module)
    assert not lookup.quantizable
    assert held_format("int4", DIM, lookup=lookup) == "fp32"
    with pytest.raises(ValueError):
        FusedTable(ROWS, DIM, "int4", lookup)


def test_a_float32_table_widened_from_fused_keeps_the_modules_call() -> None:
    table, values = held(nn.Embedding(ROWS, DIM))
    wider = table.converted("fp32")
    assert isinstance(wider, Float32Table) and isinstance(wider.module, nn.Embedding)
    ids = torch.randint(0, ROWS, (3, 2))
    assert torch.equal(wider.module(ids), table.module(ids))
    assert torch.equal(wider.values(), values)
