"""The key layout of one model in a store (docs/FORMAT.md section 1).

One model NAME owns the keys under `NAME/`:

    NAME/HEAD                                   the commit point (schemas/manifest.py Head)
    NAME/RELEASED                               what the fleet serves (schemas/release.py)
    NAME/releases/SSSSSSSSSSSS-TOKEN.json       release record S (one move of RELEASED)
    NAME/evaluations/VVVVVVVVVVVV.json          version V's evaluation and the gate's decision
    NAME/LEASE                                  the single-writer lease
    NAME/probe-TOKEN                            writer TOKEN's conditional-write probe (transient)
    NAME/manifests/VVVVVVVVVVVV-TOKEN.json      the manifest of version V by writer TOKEN
    NAME/blobs/VVVVVVVVVVVV-TOKEN/...           that version's delta and tensor blobs
    NAME/blobs/VVVVVVVVVVVV-TOKEN/rRRRR/...     the blobs rank RRRR of a job wrote (section 2.1)

Inside a version's prefix a table's blobs are `IIII-TABLE.cnrd` and `IIII-TABLE.idmap` (IIII:
the table's index in the model's table order), and a row-range shard's `IIII-TABLE-ROWSTART.cnrd`.

Every module that builds or recognises a key does it here, so the layout is spelled once.
"""

from __future__ import annotations

import re

from schemas.errors import ManifestError

MAX_KEY_CHARS = 1024
#: the version a manifest or blob key names: `VVVVVVVVVVVV-` right after its prefix.
_KEY_VERSION_RE = re.compile(r"(\d{12,})-", re.ASCII)
#: an evaluation's or release record's number: `VVVVVVVVVVVV`, or `VVVVVVVVVVVV-TOKEN`.
_KEY_NUMBER_RE = re.compile(r"(\d{12,})(?:-[0-9A-Za-z]{1,128})?", re.ASCII)


def model_prefix(model: str) -> str:
    return f"{model}/"


def head_key(model: str) -> str:
    return f"{model}/HEAD"


def released_key(model: str) -> str:
    return f"{model}/RELEASED"


def releases_prefix(model: str) -> str:
    return f"{model}/releases/"


def release_record_key(model: str, sequence: int, token: str) -> str:
    return f"{releases_prefix(model)}{sequence:012d}-{token}.json"


def is_release_record_key(model: str, key: str) -> bool:
    """Whether `key` has the shape of one of `model`'s release record keys (safety:
    `check_key`)."""
    return key.startswith(releases_prefix(model)) and key.endswith(".json")


def evaluations_prefix(model: str) -> str:
    return f"{model}/evaluations/"


def evaluation_key(model: str, version: int) -> str:
    return f"{evaluations_prefix(model)}{version:012d}.json"


def lease_key(model: str) -> str:
    return f"{model}/LEASE"


def probe_key(model: str, token: str) -> str:
    """The scratch object writer TOKEN checks conditional writes with; deleted at once."""
    return f"{model}/probe-{token}"


def manifests_prefix(model: str) -> str:
    return f"{model}/manifests/"


def blobs_prefix(model: str) -> str:
    return f"{model}/blobs/"


def manifest_key(model: str, version: int, token: str) -> str:
    return f"{manifests_prefix(model)}{version:012d}-{token}.json"


def blob_prefix(model: str, version: int, token: str) -> str:
    return f"{blobs_prefix(model)}{version:012d}-{token}/"


def rank_blob_prefix(model: str, version: int, token: str, rank: int | None) -> str:
    """Where one writer's blobs of a version go: `blob_prefix`, under `rRRRR/` for a job's rank
    (None: a single process)."""
    prefix = blob_prefix(model, version, token)
    return prefix if rank is None else f"{prefix}r{rank:04d}/"


def key_version(model: str, key: str) -> int | None:
    """The version a key under `model`'s `manifests/` or `blobs/` names (`manifest_key`,
    `blob_prefix`), or None for a key of another shape."""
    for prefix in (manifests_prefix(model), blobs_prefix(model)):
        if key.startswith(prefix):
            named = _KEY_VERSION_RE.match(key, len(prefix))
            return None if named is None else int(named.group(1))
    return None


def key_version_in(prefix: str, key: str) -> int | None:
    """The number `VVVVVVVVVVVV` a key `prefix + VVVVVVVVVVVV.json` or `prefix +
    VVVVVVVVVVVV-TOKEN.json` names (an evaluation, a release record), or None for another
    shape."""
    if not key.startswith(prefix) or not key.endswith(".json"):
        return None
    named = _KEY_NUMBER_RE.fullmatch(key, len(prefix), len(key) - len(".json"))
    return None if named is None else int(named.group(1))


def table_blob_name(index: int, table: str, suffix: str, row_start: int | None = None) -> str:
    """A table blob's name inside its version's (or rank's) prefix: `IIII-TABLE.cnrd`,
    `IIII-TABLE.idmap`, or a shard's `IIII-TABLE-ROWSTART.cnrd` (`suffix` without the dot)."""
    shard = "" if row_start is None else f"-{row_start}"
    return f"{index:04d}-{safe_segment(table)}{shard}.{suffix}"


def safe_segment(name: str) -> str:
    """A table name as one key segment: every character outside `[A-Za-z0-9._-]` becomes `_`
    (module names contain dots, never slashes)."""
    cleaned = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
    return cleaned.strip(".") or "table"


def is_blob_key(model: str, key: str) -> bool:
    """Whether `key` lies under `model`'s blob prefix (safety: `check_key`).

    A manifest names its blobs and gc deletes a dropped version's blobs: a blob key anywhere else
    (HEAD, LEASE, a manifest) would let one manifest delete what is not a blob.
    """
    return key.startswith(blobs_prefix(model)) and len(key) > len(blobs_prefix(model))


def is_manifest_key(model: str, key: str) -> bool:
    """Whether `key` has the shape of one of `model`'s manifest keys (safety: `check_key`)."""
    return key.startswith(manifests_prefix(model)) and key.endswith(".json")


def is_safe_key(key: str) -> bool:
    """Whether `key` is a safe relative store key: the one rule the stores enforce on every key
    they touch and manifests on every key they name, so a key a manifest may hold is a key
    every store (and gc) can read and delete.

    Safe: 1..MAX_KEY_CHARS characters, no control characters or backslash, and `/`-separated
    segments none of which is empty, `.` or `..` (no leading, trailing or doubled slash).
    """
    return (
        0 < len(key) <= MAX_KEY_CHARS
        and "\\" not in key
        and not any(ord(c) < 0x20 for c in key)
        and not any(part in ("", ".", "..") for part in key.split("/"))
    )


def is_safe_prefix(prefix: str) -> bool:
    """Whether `prefix` is a safe prefix to list a store by: empty (everything), or a safe key
    (`is_safe_key`) followed by at most one `/`, so that every key it matches is safe too
    (`m/`, `m/blobs/`, `m/blobs/000003-`; never `/m`, `m//`, `../m/`, `m/./`)."""
    return prefix == "" or is_safe_key(prefix.removesuffix("/"))


def check_key(model: str, key: str) -> str:
    """Return `key` if it is a safe store key owned by `model`, else raise ManifestError.

    Keys come from fetched JSON: they must never reach outside the model's own prefix.
    """
    if not key.startswith(model + "/") or not is_safe_key(key):
        raise ManifestError(f"key {key!r} is not a safe key under {model + '/'!r}")
    return key
