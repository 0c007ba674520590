"""The error hierarchy of schemas/: every rejection of bytes or JSON has its own type.

All derive from `FormatError` (itself a `ValueError`), so callers that only care that input was
bad catch one type, and tests can check that each rejection path raises the documented one.
"""

from __future__ import annotations


class FormatError(ValueError):
    """Bytes or JSON that do not follow docs/FORMAT.md."""


# --- delta blob (docs/FORMAT.md section 4) ---------------------------------------------------


class BlobTooLargeError(FormatError):
    """A total length, declared size or decoded size exceeds its cap."""


class TruncatedBlobError(FormatError):
    """Fewer bytes than the fixed prefix, the header or the sections need."""


class TrailingBytesError(FormatError):
    """More bytes than the header accounts for."""


class BadMagicError(FormatError):
    """The blob does not start with the magic bytes."""


class UnsupportedVersionError(FormatError):
    """Unknown format version, or reserved flags set."""


class BadHeaderError(FormatError):
    """The JSON header is not valid: not JSON, missing/extra/mistyped field, value out of range."""


class ChecksumMismatchError(FormatError):
    """The stored checksum does not match the bytes."""


class SectionLengthError(FormatError):
    """A section's declared length disagrees with the length the header's shape implies."""


class DecompressionError(FormatError):
    """A compressed section is invalid or decompresses to another length than declared."""


class RowIndexError(FormatError):
    """The row-index section is inconsistent: bad popcount, padding, varint, order or range."""


# --- JSON documents (manifest, announcement, HEAD, lease) ------------------------------------


class ManifestError(FormatError):
    """A manifest (or HEAD/lease record) that does not validate."""


class AnnouncementError(FormatError):
    """An announcement message that does not validate."""
