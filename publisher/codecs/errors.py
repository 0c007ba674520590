"""The codecs' errors: one root (`CodecError`, bad data for the project's error hierarchy)."""

from __future__ import annotations

from schemas.errors import BadDataError


class CodecError(BadDataError, ValueError):
    """Input a codec cannot encode or decode: bad shape, dtype or values."""


class UnknownCodecError(CodecError):
    """A codec name that `publisher.codecs.CODECS` does not list."""


class NonFiniteRowsError(CodecError):
    """A row holds inf or NaN; `row` is the index of the first such row."""

    def __init__(self, row: int) -> None:
        super().__init__(
            f"row {row} holds a non-finite value (inf or NaN); codecs need finite rows"
        )
        self.row = row

    def __reduce__(self) -> tuple[type[NonFiniteRowsError], tuple[int]]:
        # Rebuilt from its fields, not its message, so it crosses to the parent process intact.
        return type(self), (self.row,)


class OutOfRangeRowsError(CodecError):
    """A row's values do not fit the codec's fp16 fields; `row` is the first such row."""

    def __init__(self, row: int, codec: str, detail: str) -> None:
        super().__init__(f"row {row} cannot be encoded as {codec}: {detail}")
        self.row = row
        self._fields = (row, codec, detail)

    def __reduce__(self) -> tuple[type[OutOfRangeRowsError], tuple[int, str, str]]:
        # Rebuilt from its fields, not its message, so it crosses to the parent process intact.
        return type(self), self._fields
