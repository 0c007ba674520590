"""Embedding tables as a subscriber holds them: float32, or FBGEMM's fused row-wise format.

With quantized tables on (`ModuleSink(quantized=True)`, `checknrun serve`'s default), a table
whose versions arrive int8/int4/int2 (or int3, adaptive or not) is held as the fused rows torch's
quantized embedding-bag kernels read, and looked up with them
(`torch.ops.quantized.embedding_bag_{byte,4bit,2bit}_rowwise_offsets`)::

    int8:  | codes: dim bytes            | scale: fp32 | bias: fp32 |
    int4:  | codes: ceil(dim / 2) bytes  | scale: fp16 | bias: fp16 |
    int2:  | codes: ceil(dim / 4) bytes  | scale: fp16 | bias: fp16 |

Codes are packed LSB first, as in a delta blob (docs/FORMAT.md section 4), so writing a blob's
rows is a copy of its codes and its scale and bias: int8 blobs carry the byte kernel's own fp32
fields (format version 3; an older int8 blob's fp16 ones widen to fp32 exactly), the others fp16
ones: nothing is decoded to float32. An int4 table takes 36 bytes per row of dim 64 instead of
256.

Exactness. A held row decodes to bias + code * scale rounded once, the value
`publisher.codecs.decode_rows` gives the blob's row: with an fp16 scale the product of a code
below 256 fits float32's 24-bit significand, so the kernels' fused multiply-add and a
multiply-then-add agree; with int8's fp32 scale the codec decodes on the unpack kernel, which
rounds once as the lookup kernel does. A lookup of one id returns exactly the float32 row a
restore of the version holds; a bag sums the same float32 rows, in the kernel's order, so it
may differ from `nn.EmbeddingBag`'s sum by float32 rounding only: |kernel - fp32| <= (bag length
- 1) * 2**-24 * sum |rows| elementwise (`SUM_ROUNDING`; a "mean" bag divides that sum by the
bag's length, within one more rounding;
tests/unit/server/test_held_tables.py checks it, and that predictions match float32 tables').

Any model's tables. A held table replaces the module it holds (`Lookup` records what that
module computes): an `nn.EmbeddingBag` (mode sum or mean; offsets or 2-D input;
`include_last_offset`; `per_sample_weights` with sum) is looked up by the kernel as bags, an
`nn.Embedding` (any input shape) as bags of one id, each returning what the module would. A
module the kernels cannot stand in for stays float32: an `nn.EmbeddingBag` of mode max (the
kernels only sum: they take a mode and ignore it), or with `padding_idx` (its bags leave that id
out, the kernel would not), and an `nn.Embedding` with `max_norm` (it renormalises rows in place
at every lookup).

Which format a table is held in (`held_format`): the finest of the codecs its versions have
brought so far, in the order int2 < int4 < int8 < fp32 (int3 is held as int4). A coarser row
fits a finer format exactly (its codes repacked, its scale and bias kept), so a table only ever
widens: a version bringing a finer codec than the table is held in (int8 rows after int4, fp16
or fp32 rows after any int) converts the whole table to the finer format first, exactly (an
int table widened to fp32 holds precisely the float32 rows a restore holds), and the
table stays in that format for the rest of the lineage (until a rebuild from a full version,
which starts from the full's codecs). Re-quantizing those rows to the held format would have
served values that no version published. A format the kernels cannot look up (a torch build
without them, or a dim the packing does not divide: 4-bit needs an even dim, 2-bit a multiple
of 4) is replaced by the next finer one that works, ending at fp32.
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

from publisher.codecs import (
    AffineCodec,
    CodecError,
    QuantizedRows,
    codec_of,
    pack_codes,
    uniform_codec,
    unpack_codes,
)
from publisher.read.blob_rows import BlobRows, decode_blob, write_blob
from schemas.delta_blob import DeltaBlob

HeldFormat = Literal["int2", "int4", "int8", "fp32"]
#: formats from coarsest to finest: a table held in one holds any coarser row exactly.
FORMAT_ORDER: Final[tuple[HeldFormat, ...]] = ("int2", "int4", "int8", "fp32")
#: the fused formats and the codec whose rows each holds as they are (its bits, its decoder).
_FORMAT_CODEC: Final[dict[HeldFormat, AffineCodec]] = {
    "int2": uniform_codec(2),
    "int4": uniform_codec(4),
    "int8": uniform_codec(8),
}
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
    scale: npt.NDArray[np.floating],
    bias: npt.NDArray[np.floating],
) -> None:
    """Write fused rows of `out`'s width from packed `codes` of `codes_bits` bits (at most the
    held bits: coarser codes are repacked) and their `scale`, `bias`: fp16, or fp32 into an
    8-bit table (int8's own)."""
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
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.floating], npt.NDArray[np.floating]]:
    """(packed codes, scale, bias) of fused rows, as contiguous copies: fp32 fields for 8 bits
    (int8's), fp16 ones below."""
    rb = (dim * bits + 7) // 8
    codes = np.ascontiguousarray(fused[:, :rb])
    if bits == 8:
        fields = fused[:, rb : rb + 8].view(np.float32)
        return codes, np.ascontiguousarray(fields[:, 0]), np.ascontiguousarray(fields[:, 1])
    halves = fused[:, rb : rb + 4].view(np.float16)
    return codes, np.ascontiguousarray(halves[:, 0]), np.ascontiguousarray(halves[:, 1])


_LOOKUP: Final = {bits: op for bits in (8, 4, 2) if (op := _lookup_op(bits)) is not None}


def looks_up(fmt: HeldFormat, dim: int) -> bool:
    """True if a table of `dim` can be held and looked up in `fmt` on this torch."""
    if fmt == "fp32":
        return True
    bits = _FORMAT_CODEC[fmt].bits
    return bits in _LOOKUP and dim % (8 // bits) == 0


def held_format(
    codec: str, dim: int, current: HeldFormat | None = None, lookup: Lookup | None = None
) -> HeldFormat:
    """The format a table of `dim` held in `current` (None: a new table) must be held in to take
    rows of `codec` exactly: the finer of the two, moved up to one the kernels can look up;
    fp32 for a module the kernels cannot stand in for (`lookup`, default a plain bag)."""
    if lookup is not None and not lookup.quantizable:
        return "fp32"
    rows = codec_of(codec)
    # The coarsest format whose codes are at least as wide as the rows' (int3 is held as int4).
    wanted: HeldFormat = next(
        (f for f, held in _FORMAT_CODEC.items() if rows.affine and rows.bits <= held.bits), "fp32"
    )
    start = FORMAT_ORDER.index(wanted)
    if current is not None:
        start = max(start, FORMAT_ORDER.index(current))
    return next(f for f in FORMAT_ORDER[start:] if looks_up(f, dim))


LookupKind = Literal["bag", "embedding"]
#: the bag modes a fused table answers: the kernels sum (they take a mode argument and ignore
#: it), and a mean is that sum over the bag's length; a max they cannot make.
_FUSED_BAG_MODES: Final = ("sum", "mean")


@dataclass(frozen=True)
class Lookup:
    """What the model's module of a table computes, so that a held table answers the same call:
    an `nn.EmbeddingBag` (`kind="bag"`: its mode, `include_last_offset`, `padding_idx`) or an
    `nn.Embedding` (`kind="embedding"`: `padding_idx`, `max_norm`)."""

    kind: LookupKind = "bag"
    mode: str = "sum"
    include_last_offset: bool = False
    padding_idx: int | None = None
    max_norm: float | None = None

    @classmethod
    def of(cls, module: nn.Module) -> Lookup:
        """The lookup `module` (an `nn.EmbeddingBag` or `nn.Embedding`) makes."""
        if isinstance(module, nn.EmbeddingBag):
            return cls(
                "bag",
                mode=str(module.mode),
                include_last_offset=bool(module.include_last_offset),
                padding_idx=module.padding_idx,
            )
        if isinstance(module, nn.Embedding):
            return cls("embedding", padding_idx=module.padding_idx, max_norm=module.max_norm)
        raise TypeError(f"{type(module).__name__} is not an nn.Embedding or nn.EmbeddingBag")

    @property
    def quantizable(self) -> bool:
        """Whether the fused kernels compute what the module does (module docstring)."""
        if self.kind == "bag":
            return self.mode in _FUSED_BAG_MODES and self.padding_idx is None
        return self.max_norm is None

    def float32_module(self, weights: torch.Tensor) -> nn.Module:
        """A module making this lookup over `weights` (shared, not copied)."""
        if self.kind == "bag":
            return nn.EmbeddingBag.from_pretrained(
                weights,
                freeze=True,
                mode=self.mode,
                include_last_offset=self.include_last_offset,
                padding_idx=self.padding_idx,
            )
        embedding: nn.Embedding = nn.Embedding.from_pretrained(  # type: ignore[no-untyped-call]
            weights, freeze=True, padding_idx=self.padding_idx, max_norm=self.max_norm
        )
        return embedding


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
    lookup: Lookup
    rows: int
    dim: int

    @property
    @abstractmethod
    def module(self) -> nn.Module:
        """The module the model calls for this table: it takes the call the module it replaces
        took (`lookup`), e.g. `module(values, offsets)` for a bag."""

    @property
    @abstractmethod
    def array(self) -> np.ndarray:
        """The table's memory, one row per table row."""

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, dim) of the table's values."""
        return self.rows, self.dim

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

    @property
    @abstractmethod
    def tensor(self) -> torch.Tensor:
        """The tensor whose memory `array` views (what the lookup module reads)."""

    def share_memory(self) -> None:
        """Move the table's memory to shared memory (`checknrun serve --workers`), in place:
        the module reads the same tensor, and `array` views the new memory. (Moving frees the
        old memory, so a view taken before would dangle: the view is taken again here.)"""
        self.tensor.share_memory_()  # type: ignore[no-untyped-call]
        self._view()

    @abstractmethod
    def _view(self) -> None:
        """Take `array` again from `tensor`."""

    def __getstate__(self) -> dict[str, object]:
        # Pickled (to a worker process, with the tensor in shared memory) without the numpy
        # view, which pickle would copy: the view is taken again from the tensor.
        state = dict(self.__dict__)
        state.pop(self._VIEW, None)
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._view()

    #: the attribute holding the numpy view of `tensor`.
    _VIEW = ""

    @abstractmethod
    def empty_like(self) -> HeldTable:
        """A table of the same format, shape and lookup, contents undefined."""

    def scatter(self, rows: TableRows) -> None:
        """Write rows `rows_of` or `write_blob` returned for a table of this format."""
        rows.scatter(self.array)

    def zero_rows(self, ids: npt.NDArray[np.int64]) -> None:
        """Set rows `ids` to zero: every value 0.0 (a fused row's codes, scale and bias 0)."""
        self.array[ids] = 0

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
            return Float32Table.of(self.values(), self.lookup)
        wider = FusedTable(self.rows, self.dim, fmt, self.lookup)
        for start in range(0, self.rows, CHUNK_ROWS):
            sl = slice(start, start + CHUNK_ROWS)
            codes, scale, bias = _fields(self.fused[sl], self.bits, self.dim)
            _fill(wider.fused[sl], codes, self.bits, self.dim, scale, bias)
        return wider


class Float32Table(HeldTable):
    """A float32 table: the model's own `nn.EmbeddingBag` or `nn.Embedding`, written by
    decoding rows into its weight."""

    format: HeldFormat = "fp32"

    def __init__(self, embedding: nn.Embedding | nn.EmbeddingBag) -> None:
        weight = embedding.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(
                f"a held table is float32 on the CPU; this one is {weight.dtype} on {weight.device}"
            )
        if not weight.is_contiguous():
            raise ValueError("a held table's weight must be contiguous")
        self.embedding = embedding
        self.lookup = Lookup.of(embedding)
        self.weights: npt.NDArray[np.float32] = weight.data.numpy()
        self.rows, self.dim = self.weights.shape

    @classmethod
    def of(cls, weights: torch.Tensor, lookup: Lookup | None = None) -> Float32Table:
        """A table whose weights are `weights` (shared, not copied), making `lookup`."""
        module = (lookup or Lookup()).float32_module(weights)
        assert isinstance(module, nn.Embedding | nn.EmbeddingBag)
        return cls(module)

    @property
    def module(self) -> nn.Module:
        return self.embedding

    @property
    def array(self) -> np.ndarray:
        return self.weights

    @property
    def tensor(self) -> torch.Tensor:
        return self.embedding.weight

    _VIEW = "weights"

    def _view(self) -> None:
        self.weights = self.embedding.weight.data.numpy()

    def values(self) -> torch.Tensor:
        return self.embedding.weight.data

    def write_blob(self, blob: DeltaBlob) -> BlobRows | None:
        return write_blob(blob, self.weights)

    def rows_of(self, blob: DeltaBlob) -> BlobRows:
        return decode_blob(blob)

    def empty_like(self) -> Float32Table:
        return Float32Table.of(torch.empty(self.rows, self.dim), self.lookup)


class FusedLookup(nn.Module):
    """The module a fused table stands in with: the call of the `nn.EmbeddingBag` or
    `nn.Embedding` it replaces (`lookup`), answered by torch's rowwise kernel. The fused rows are
    a plain attribute, not a buffer: the model's state_dict stays the published one's."""

    def __init__(self, fused: torch.Tensor, bits: int, lookup: Lookup) -> None:
        super().__init__()
        self.fused = fused
        self.lookup = lookup
        self.bits = bits
        self._kernel = _LOOKUP[bits]

    def __getstate__(self) -> dict[str, object]:
        # torch's kernel is not picklable: it is looked up again by its bits.
        state = dict(self.__dict__)
        del state["_kernel"]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        self._kernel = _LOOKUP[self.bits]

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.lookup.kind == "embedding":
            flat = input.reshape(-1)
            starts = torch.arange(flat.numel(), dtype=flat.dtype, device=flat.device)
            out = self._bags(flat, starts, None, include_last=False)
            return out.reshape(*input.shape, out.shape[-1])
        include_last = self.lookup.include_last_offset
        if input.dim() == 2:  # fixed-length bags, as nn.EmbeddingBag takes them
            length = int(input.shape[1])
            offsets = torch.arange(0, input.numel(), max(length, 1), dtype=input.dtype)
            if length == 0:
                offsets = torch.zeros(int(input.shape[0]), dtype=input.dtype)
            input = input.reshape(-1)
            if per_sample_weights is not None:
                per_sample_weights = per_sample_weights.reshape(-1)
            include_last = False
        if offsets is None:
            raise ValueError("offsets are required for a 1-D input of a bag")
        sums = self._bags(input, offsets, per_sample_weights, include_last)
        if self.lookup.mode != "mean":
            return sums
        # The bags' lengths from their offsets; an empty bag is 0, as nn.EmbeddingBag gives.
        ends = (
            offsets[1:]
            if include_last
            else torch.cat([offsets[1:], offsets.new_tensor([input.numel()])])
        )
        starts = offsets[:-1] if include_last else offsets
        lengths = (ends - starts).clamp(min=1).to(sums.dtype)
        return sums / lengths.unsqueeze(1)

    def _bags(
        self,
        values: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        include_last: bool,
    ) -> torch.Tensor:
        # (weight, indices, offsets, scale_grad_by_freq, mode (ignored: a sum), pruned_weights,
        #  per_sample_weights, compressed_indices_mapping, include_last_offset); the kernel
        # wants offsets of the indices' dtype (a KeyedJaggedTensor's may be int32).
        return self._kernel(
            self.fused,
            values,
            offsets.to(values.dtype),
            False,
            0,
            False,
            weights,
            None,
            include_last,
        )


class FusedTable(HeldTable):
    """A table of fused int8/int4/int2 rows, looked up by torch's rowwise embedding-bag kernel."""

    def __init__(self, rows: int, dim: int, fmt: HeldFormat, lookup: Lookup | None = None) -> None:
        self.lookup = lookup or Lookup()
        if not looks_up(fmt, dim) or not self.lookup.quantizable:
            raise ValueError(f"a table of dim {dim} cannot be held in {fmt} on this torch")
        self.format = fmt
        self.rows, self.dim = rows, dim
        self.codec = _FORMAT_CODEC[fmt]
        self.bits = self.codec.bits
        self.fused_tensor = torch.empty((rows, fused_row_bytes(self.bits, dim)), dtype=torch.uint8)
        self.fused: npt.NDArray[np.uint8] = self.fused_tensor.numpy()
        self._module = FusedLookup(self.fused_tensor, self.bits, self.lookup)

    @property
    def module(self) -> nn.Module:
        return self._module

    @property
    def array(self) -> np.ndarray:
        return self.fused

    @property
    def tensor(self) -> torch.Tensor:
        return self.fused_tensor

    _VIEW = "fused"

    def _view(self) -> None:
        self.fused = self.fused_tensor.numpy()

    def values(self) -> torch.Tensor:
        out = np.empty((self.rows, self.dim), dtype=np.float32)
        for start in range(0, self.rows, CHUNK_ROWS):
            sl = slice(start, start + CHUNK_ROWS)
            codes, scale, bias = _fields(self.fused[sl], self.bits, self.dim)
            rows = QuantizedRows(self.codec.name, self.dim, codes, scale, bias)
            self.codec.decode(rows, out=out[sl])
        return torch.from_numpy(out)

    def _check(self, blob: DeltaBlob) -> int:
        rows = codec_of(blob.codec)
        if (blob.table_rows, blob.dim) != self.shape:
            raise ValueError(
                f"blob for {blob.table!r} is {(blob.table_rows, blob.dim)}, the table {self.shape}"
            )
        # A blob of no rows brings none to fit, whatever its codec: a version encoded finer as a
        # whole leaves a table it did not touch as it is held (as ModelCopy.stage skips it).
        if blob.n_rows and (not rows.affine or rows.bits > self.bits):
            raise ValueError(f"{blob.codec} rows do not fit a table held in {self.format}")
        _check_scales(blob)
        return rows.bits

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
        if blob.n_rows:
            _fill(fused, blob.codes, bits, self.dim, blob.scale, blob.bias)
        # The blob's ids are a view of the fetched bytes: an own copy does not keep them alive.
        return FusedRows(blob.row_ids.copy(), fused)

    def empty_like(self) -> FusedTable:
        return FusedTable(self.rows, self.dim, self.format, self.lookup)


def new_table(rows: int, dim: int, fmt: HeldFormat, lookup: Lookup | None = None) -> HeldTable:
    """An empty table of `fmt` making `lookup` (default: a sum bag), contents undefined until a
    full version writes it."""
    if fmt == "fp32":
        return Float32Table.of(torch.empty(rows, dim), lookup)
    return FusedTable(rows, dim, fmt, lookup)
