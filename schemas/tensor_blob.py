"""Dense parameters and optimizer state as safetensors bytes (docs/FORMAT.md section 5).

safetensors is a length-prefixed JSON header plus a fully indexed buffer and executes no code on
load, which is why it is used instead of torch.save for anything that goes to the store. How torch
state dicts become these named arrays is publisher/state_dicts.py's business.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from schemas import strict_json
from schemas.errors import FormatError

MAX_TENSOR_BLOB_BYTES = 4 * 1024**3


class TensorBlobError(FormatError):
    """Tensor blob bytes that safetensors or our metadata rules refuse."""


def encode_tensors(tensors: dict[str, np.ndarray], meta: dict[str, Any] | None = None) -> bytes:
    """safetensors bytes of `tensors`, with `meta` JSON in the header's metadata."""
    metadata = {"checknrun": json.dumps(meta or {}, sort_keys=True)}
    # np.require keeps 0-d arrays 0-d (ascontiguousarray would make them shape (1,)).
    arrays = {k: np.require(v, requirements="C") for k, v in tensors.items()}
    return bytes(st_save(arrays, metadata=metadata))


def tensor_bytes(data: bytes) -> int:
    """Bytes of the tensors a tensor blob holds: its length less the length prefix and header.

    This is the blob's share of a full fp32 checkpoint (docs/FORMAT.md section 3.1); the header
    is container overhead.
    """
    return len(data) - 8 - _header_len(data)


def decode_tensors(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Tensors and metadata from safetensors bytes; TensorBlobError on anything malformed."""
    header_len = _header_len(data)
    header = strict_json.loads(data[8 : 8 + header_len], TensorBlobError, "tensor blob header")
    if not isinstance(header, dict):
        raise TensorBlobError("tensor blob header must be a JSON object")
    try:
        tensors = st_load(data)
    except (SafetensorError, ValueError) as exc:
        raise TensorBlobError(f"invalid tensor blob: {exc}") from exc
    # safetensors has checked that the metadata maps strings to strings.
    raw_meta = (header.get("__metadata__") or {}).get("checknrun", "{}")
    meta = strict_json.loads(raw_meta, TensorBlobError, "tensor blob metadata")
    if not isinstance(meta, dict):
        raise TensorBlobError("tensor blob metadata must be a JSON object")
    return tensors, meta


def _header_len(data: bytes) -> int:
    """The declared JSON header length, checked against the caps and the blob's length."""
    if len(data) > MAX_TENSOR_BLOB_BYTES:
        raise TensorBlobError(f"tensor blob is {len(data)} bytes; cap {MAX_TENSOR_BLOB_BYTES}")
    if len(data) < 8:
        raise TensorBlobError(f"tensor blob is {len(data)} bytes; at least 8 expected")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > len(data) - 8 or header_len > 100 * 1024 * 1024:
        raise TensorBlobError(f"tensor blob header length {header_len} exceeds the blob")
    return header_len
