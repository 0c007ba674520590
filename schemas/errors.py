"""Every error checknrun raises on purpose: one root, and a branch that says what to do about it.

    CheckNRunError        the root: a failure checknrun foresaw and describes
    +- BadDataError       the input or the state is wrong (hostile or malformed bytes, a bad
    |  |                  manifest, config or argument, no such version): retrying won't help
    |  +- FormatError     bytes or JSON that do not follow docs/FORMAT.md (the types below)
    +- UnavailableError   a service could not be reached or timed out: retry later
    +- ConflictError      another writer holds or moved what this one meant to change (a held
                          lease, a lost compare-and-swap): stop that writer, or wait

Each package keeps its own small hierarchy (`StoreError`, `CodecError`, `RestoreError`, ...) and
each class picks its branch once, here in its bases; callers decide by branch and never list
types. A package base that is raised for reasons of several kinds (`StoreError` for a refused or
misconfigured store) sits directly under the root. Anything that is not a `CheckNRunError` (a
bare ValueError, TypeError, KeyError...) is a bug and is left to propagate with its traceback.

The bad-data classes keep the builtin base they always had (`FormatError` is a ValueError, so
pydantic validators and callers that catch ValueError still see one).
"""

from __future__ import annotations


class CheckNRunError(Exception):
    """Root of every error checknrun raises on purpose."""


class BadDataError(CheckNRunError):
    """The input or state is wrong: retrying the same thing will not help."""


class UnavailableError(CheckNRunError):
    """A service could not be reached or timed out: the same thing may work later."""


class ConflictError(CheckNRunError):
    """Another writer holds or moved what this one meant to change."""


class FormatError(BadDataError, ValueError):
    """Bytes or JSON that do not follow docs/FORMAT.md; each rejection has its own subclass."""


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
