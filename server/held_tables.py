"""Embedding tables as a server holds them: float32, or FBGEMM's fused row-wise format.

With quantized serving on (settings `quantized_tables`, the default), a table whose versions
arrive int8/int4/int2 (or int3, adaptive or not) is held as the fused rows torch's quantized
embedding-bag kernels read, and looked up with them
(`torch.ops.quantized.embedding_bag_{byte,4bit,2bit}_rowwise_offsets`)::

    int8:  | codes: dim bytes            | scale: fp32 | bias: fp32 |
    int4:  | codes: ceil(dim / 2) bytes  | scale: fp16 | bias: fp16 |
    int2:  | codes: ceil(dim / 4) bytes  | scale: fp16 | bias: fp16 |

Codes are packed LSB first, as in a delta blob (docs/FORMAT.md section 4), so writing a blob's
rows is a copy of its codes and its fp16 scale and bias (widened to fp32 for int8, which holds
an fp16 value exactly): nothing is decoded to float32. An int4 table takes 36 bytes per row of
dim 64 instead of 256.

Exactness. A held row decodes to bias + code * scale, the value `publisher.codecs.decode_rows`
gives the blob's row: the product of an fp16 scale and a code below 256 fits float32's 24-bit
significand, so the kernels' fused multiply-add and the codec's multiply-then-add round once,
the same way. A lookup of one id returns exactly the float32 row today's server holds; a bag
sums the same float32 rows, in the kernel's order, so it may differ from `nn.EmbeddingBag`'s
sum by float32 rounding only: |kernel - fp32| <= (bag length - 1) * 2**-24 * sum |rows|
elementwise (`SUM_ROUNDING`; tests/unit/server/test_held_tables.py checks it, and that
predictions match the float32 server's).

Which format a table is held in (`held_format`): the finest of the codecs its versions have
brought so far, in the order int2 < int4 < int8 < fp32 (int3 is held as int4). A coarser row
fits a finer format exactly (its codes repacked, its scale and bias kept), so a table only ever
widens: a version bringing a finer codec than the table is held in (int8 rows after int4, fp16
or fp32 rows after any int) converts the whole table to the finer format first, exactly (an
int table widened to fp32 holds precisely the float32 rows today's server would), and the
table stays in that format for the rest of the lineage (until a rebuild from a full version,
which starts from the full's codecs). Re-quantizing those rows to the held format would have
served values that no version published. A format the kernels cannot look up (a torch build
without them, or a dim the packing does not divide: 4-bit needs an even dim, 2-bit a multiple
of 4) is replaced by the next finer one that works, ending at fp32: today's path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from publisher.codecs import CodecError, QuantizedRows, decode_rows, pack_codes, unpack_codes
from publisher.read.blob_rows import BlobRows, decode_blob, write_blob
from schemas.codec_names import CODEC_BITS, is_integer_codec
from schemas.delta_blob import DeltaBlob

HeldFormat = Literal["int2", "int4", "int8", "fp32"]
#: formats from coarsest to finest: a table held in one holds any coarser row exactly.
FORMAT_ORDER: Final[tuple[HeldFormat, ...]] = ("int2", "int4", "int8", "fp32")
_FORMAT_BITS: Final[dict[HeldFormat, int]] = {"int2": 2, "int4": 4, "int8": 8}
#: rows converted at a time (dequantizing, widening): the chunk's temporaries stay in cache.
CHUNK_ROWS: Final = 1 << 14
#: float32's unit roundoff: the bound of a bag sum's reordering per added row (module doc).
SUM_ROUNDING: Final = 2.0**-24

_Kernel = Callable[..., torch.Tensor]


def _lookup_op(bits: int) -> _Kernel | None:
    """The rowwise embedding-bag kernel of `bits`, if this torch has it and it reads the
    layout above: one row of codes 1, scale 0.5, bias -1 must look up as -0.5 everywhere."""
    name = (
        "embedding_bag_byte_rowwise_offsets"
        if bits == 8
        else f"embedding_bag_{bits}bit_rowwise_offsets"
    )
    try:
        op: _Kernel = getattr(torch.ops.quantized, name)
        dim = 8
        fused = np.zeros((1, fused_row_bytes(bits, dim)), dtype=np.uint8)
        _fill(fused, pack_codes(np.ones((1, dim), np.uint8), bits), bits, dim, *_half(0.5, -1.0))
        out = op(
            torch.from_numpy(fused),
            torch.zeros(1, dtype=torch.int64),
            torch.zeros(1, dtype=torch.int64),
            False,
            0,
            False,
            None,
            None,
            False,
        )
        works = out.shape == (1, dim) and bool(torch.all(out == -0.5))
        return op if works else None
    except (AttributeError, RuntimeError, NotImplementedError, TypeError):  # absent or unlike
        return None


def _half(scale: float, bias: float) -> tuple[np.ndarray, np.ndarray]:
    return np.array([scale], np.float16), np.array([bias], np.float16)


def fused_row_bytes(bits: int, dim: int) -> int:
    """Bytes of one held row: the packed codes, then scale and bias (fp32 for 8 bits)."""
    return (dim * bits + 7) // 8 + (8 if bits == 8 else 4)


def _fill(
    out: npt.NDArray[np.uint8],
    codes: npt.NDArray[np.uint8],
    codes_bits: int,
    dim: int,
    scale: npt.NDArray[np.float16],
    bias: npt.NDArray[np.float16],
) -> None:
    """Write fused rows of `out`'s width from packed `codes` of `codes_bits` bits (at most the
    held bits: coarser codes are repacked) and fp16 `scale`, `bias`."""
    bits = _bits_of_width(out.shape[1], dim)
    rb = (dim * bits + 7) // 8
    if codes_bits != bits:
        codes = pack_codes(unpack_codes(codes, codes_bits, dim), bits)
    out[:, :rb] = codes
    if bits == 8:
        fields = out[:, rb : rb + 8].view(np.float32)
        fields[:, 0] = scale
        fields[:, 1] = bias
    else:
        halves = out[:, rb : rb + 4].view(np.float16)
        halves[:, 0] = scale
        halves[:, 1] = bias


def _bits_of_width(width: int, dim: int) -> int:
    for bits in (8, 4, 2):
        if fused_row_bytes(bits, dim) == width:
            return bits
    raise ValueError(f"no fused format of dim {dim} has {width} bytes per row")


def _fields(
    fused: npt.NDArray[np.uint8], bits: int, dim: int
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float16], npt.NDArray[np.float16]]:
    """(packed codes, fp16 scale, fp16 bias) of fused rows, as contiguous copies."""
    rb = (dim * bits + 7) // 8
    codes = np.ascontiguousarray(fused[:, :rb])
    if bits == 8:
        fields = fused[:, rb : rb + 8].view(np.float32)
        # Exact: the fp32 fields were written from fp16 values.
        return codes, fields[:, 0].astype(np.float16), fields[:, 1].astype(np.float16)
    halves = fused[:, rb : rb + 4].view(np.float16)
    return codes, np.ascontiguousarray(halves[:, 0]), np.ascontiguousarray(halves[:, 1])


_LOOKUP: Final = {bits: op for bits in (8, 4, 2) if (op := _lookup_op(bits)) is not None}


def looks_up(fmt: HeldFormat, dim: int) -> bool:
    """True if a table of `dim` can be held and looked up in `fmt` on this torch."""
    if fmt == "fp32":
        return True
    bits = _FORMAT_BITS[fmt]
    return bits in _LOOKUP and dim % (8 // bits) == 0


def held_format(codec: str, dim: int, current: HeldFormat | None = None) -> HeldFormat:
    """The format a table of `dim` held in `current` (None: a new table) must be held in to take
    rows of `codec` exactly: the finer of the two, moved up to one the kernels can look up."""
    if is_integer_codec(codec):
        bits = CODEC_BITS[codec]
        wanted: HeldFormat = "int2" if bits == 2 else "int4" if bits <= 4 else "int8"
    else:
        wanted = "fp32"
    start = FORMAT_ORDER.index(wanted)
    if current is not None:
        start = max(start, FORMAT_ORDER.index(current))
    return next(f for f in FORMAT_ORDER[start:] if looks_up(f, dim))


def _check_scales(blob: DeltaBlob) -> None:
    """CodecError on a non-finite scale or bias, as decoding the blob would raise."""
    for name, arr in (("scale", blob.scale), ("bias", blob.bias)):
        bad = ~np.isfinite(arr)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise CodecError(f"{name} of row {row} is {arr[row]}; scale and bias must be finite")


@dataclass(frozen=True)
class FusedRows:
    """Some rows of a fused table, kept so that the same write can be repeated on another copy
    of the table or made later (under a lock)."""

    ids: npt.NDArray[np.int64]  # (n,), strictly increasing
    fused: npt.NDArray[np.uint8]  # (n, fused row bytes)

    def scatter(self, table: npt.NDArray[np.uint8]) -> None:
        """Write the rows into `table` (rows, fused row bytes)."""
        _row_items(table)[self.ids] = _row_items(self.fused)


#: rows written to a table, in the table's format.
TableRows = BlobRows | FusedRows


def _row_items(rows: npt.NDArray[np.uint8]) -> npt.NDArray[np.void]:
    """(n, k) bytes as n k-byte items sharing memory: numpy moves an item whole (one copy per
    row instead of k)."""
    return rows.view(np.dtype((np.void, rows.shape[1])))[:, 0]


class HeldTable(ABC):
    """One embedding table of a served model: its format, its lookup module, and the writes a
    version makes to it (the consistency schemes call them only while no reader sees it)."""

    format: HeldFormat

    @property
    @abstractmethod
    def module(self) -> nn.Module:
        """What the model calls as `module(values, offsets)` to sum the rows of each bag."""

    @property
    @abstractmethod
    def array(self) -> np.ndarray:
        """The table's memory, one row per table row."""

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, dim) of the table's values."""
        return self.rows, self.dim

    rows: int
    dim: int

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    @abstractmethod
    def values(self) -> torch.Tensor:
        """The table as float32 (rows, dim): the weights themselves, or a decoded copy."""

    @abstractmethod
    def write_blob(self, blob: DeltaBlob) -> TableRows | None:
        """Write `blob`'s rows (of this table's shape, a codec no finer than this format);
        the rows written, or None when the blob held every row (written in place)."""

    @abstractmethod
    def rows_of(self, blob: DeltaBlob) -> TableRows:
        """`blob`'s rows in this table's format, not written."""

    @abstractmethod
    def empty_like(self) -> HeldTable:
        """A table of the same format and shape, contents undefined."""

    def scatter(self, rows: TableRows) -> None:
        """Write rows `rows_of` or `write_blob` returned for a table of this format."""
        rows.scatter(self.array)

    def copy_from(self, source: HeldTable, ids: npt.NDArray[np.int64] | None = None) -> None:
        """Make rows `ids` (None: every row) equal to `source`'s, of the same format."""
        if source.format != self.format:
            raise ValueError(f"cannot copy a {source.format} table into a {self.format} one")
        if ids is None:
            np.copyto(self.array, source.array)
        else:
            self.array[ids] = source.array[ids]

    def copy(self) -> HeldTable:
        """An own copy of this table."""
        other = self.empty_like()
        other.copy_from(self)
        return other

    def converted(self, fmt: HeldFormat) -> HeldTable:
        """A new table in `fmt` (this format or a finer one) holding exactly this table's values."""
        if fmt == self.format:
            return self.copy()
        if FORMAT_ORDER.index(fmt) < FORMAT_ORDER.index(self.format):
            raise ValueError(f"a {self.format} table cannot be narrowed to {fmt}")
        assert isinstance(self, FusedTable)  # fp32 is the finest
        if fmt == "fp32":
            return Float32Table.of(self.values())
        wider = FusedTable(self.rows, self.dim, fmt)
        for start in range(0, self.rows, CHUNK_ROWS):
            sl = slice(start, start + CHUNK_ROWS)
            codes, scale, bias = _fields(self.fused[sl], self.bits, self.dim)
            _fill(wider.fused[sl], codes, self.bits, self.dim, scale, bias)
        return wider


class Float32Table(HeldTable):
    """A float32 table: the `nn.EmbeddingBag` of today's server, written by decoding."""

    format: HeldFormat = "fp32"

    def __init__(self, bag: nn.EmbeddingBag) -> None:
        self.bag = bag
        self.weights: npt.NDArray[np.float32] = bag.weight.data.numpy()
        self.rows, self.dim = self.weights.shape

    @classmethod
    def of(cls, weights: torch.Tensor) -> Float32Table:
        """A table whose weights are `weights` (shared, not copied)."""
        bag = nn.EmbeddingBag.from_pretrained(weights, freeze=True, mode="sum", sparse=True)
        return cls(bag)

    @property
    def module(self) -> nn.Module:
        return self.bag

    @property
    def array(self) -> np.ndarray:
        return self.weights

    def values(self) -> torch.Tensor:
        return self.bag.weight.data

    def write_blob(self, blob: DeltaBlob) -> BlobRows | None:
        return write_blob(blob, self.weights)

    def rows_of(self, blob: DeltaBlob) -> BlobRows:
        return decode_blob(blob)

    def empty_like(self) -> Float32Table:
        return Float32Table.of(torch.empty(self.rows, self.dim))


class FusedTable(HeldTable, nn.Module):
    """A table of fused int8/int4/int2 rows, looked up by torch's rowwise embedding-bag kernel."""

    def __init__(self, rows: int, dim: int, fmt: HeldFormat) -> None:
        nn.Module.__init__(self)
        if not looks_up(fmt, dim):
            raise ValueError(f"a table of dim {dim} cannot be held in {fmt} on this torch")
        self.format = fmt
        self.rows, self.dim = rows, dim
        self.bits = _FORMAT_BITS[fmt]
        self.fused_tensor = torch.empty((rows, fused_row_bytes(self.bits, dim)), dtype=torch.uint8)
        self.fused: npt.NDArray[np.uint8] = self.fused_tensor.numpy()
        self._lookup = _LOOKUP[self.bits]

    def forward(self, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        # (weight, indices, offsets, scale_grad_by_freq, mode=sum, pruned_weights,
        #  per_sample_weights, compressed_indices_mapping, include_last_offset)
        return self._lookup(self.fused_tensor, values, offsets, False, 0, False, None, None, False)

    @property
    def module(self) -> nn.Module:
        return self

    @property
    def array(self) -> np.ndarray:
        return self.fused

    def values(self) -> torch.Tensor:
        out = np.empty((self.rows, self.dim), dtype=np.float32)
        codec = f"int{self.bits}"
        for start in range(0, self.rows, CHUNK_ROWS):
            sl = slice(start, start + CHUNK_ROWS)
            codes, scale, bias = _fields(self.fused[sl], self.bits, self.dim)
            decode_rows(QuantizedRows(codec, self.dim, codes, scale, bias), out=out[sl])
        return torch.from_numpy(out)

    def _check(self, blob: DeltaBlob) -> int:
        bits = CODEC_BITS[blob.codec]
        if not is_integer_codec(blob.codec) or bits > self.bits:
            raise ValueError(f"{blob.codec} rows do not fit a table held in {self.format}")
        if (blob.table_rows, blob.dim) != self.shape:
            raise ValueError(
                f"blob for {blob.table!r} is {(blob.table_rows, blob.dim)}, the table {self.shape}"
            )
        _check_scales(blob)
        return bits

    def write_blob(self, blob: DeltaBlob) -> FusedRows | None:
        if blob.n_rows != self.rows:
            rows = self.rows_of(blob)
            rows.scatter(self.fused)
            return rows
        bits = self._check(blob)
        for start in range(0, self.rows, CHUNK_ROWS):
            sl = slice(start, start + CHUNK_ROWS)
            _fill(self.fused[sl], blob.codes[sl], bits, self.dim, blob.scale[sl], blob.bias[sl])
        return None

    def rows_of(self, blob: DeltaBlob) -> FusedRows:
        bits = self._check(blob)
        fused = np.empty((blob.n_rows, self.fused.shape[1]), dtype=np.uint8)
        _fill(fused, blob.codes, bits, self.dim, blob.scale, blob.bias)
        # The blob's ids are a view of the fetched bytes: an own copy does not keep them alive.
        return FusedRows(blob.row_ids.copy(), fused)

    def empty_like(self) -> FusedTable:
        return FusedTable(self.rows, self.dim, self.format)


def new_table(rows: int, dim: int, fmt: HeldFormat) -> HeldTable:
    """An empty table of `fmt` (contents undefined until a full version writes it)."""
    if fmt == "fp32":
        return Float32Table.of(torch.empty(rows, dim))
    return FusedTable(rows, dim, fmt)
