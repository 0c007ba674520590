"""Tensor blobs: the tensor bytes a manifest records are the blob less its header (FORMAT.md
3.1)."""

from __future__ import annotations

import numpy as np
import pytest

from schemas.tensor_blob import TensorBlobError, decode_tensors, encode_tensors, tensor_bytes


def test_tensor_bytes_are_the_tensors_without_the_header() -> None:
    tensors: dict[str, np.ndarray] = {
        "w": np.ones((3, 5), dtype=np.float32),
        "step": np.array(7.0, dtype=np.float32),
        "count": np.arange(4, dtype=np.int64),
    }
    data = encode_tensors(tensors, {"param_groups": [{"lr": 0.1}]})
    assert tensor_bytes(data) == sum(a.nbytes for a in tensors.values()) == 60 + 4 + 32
    assert len(data) > tensor_bytes(data)  # the header is container overhead
    assert tensor_bytes(encode_tensors({})) == 0


@pytest.mark.parametrize(
    "data",
    [b"", b"\x01" * 7, (1000).to_bytes(8, "little") + b"{}"],
)
def test_tensor_bytes_refuses_what_decode_refuses(data: bytes) -> None:
    with pytest.raises(TensorBlobError):
        tensor_bytes(data)
    with pytest.raises(TensorBlobError):
        decode_tensors(data)


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("where", ["header", "metadata"])
def test_deeply_nested_json_is_a_tensor_blob_error(where: str) -> None:
    # json's decoder recurses once per level: hostile nesting must not escape as RecursionError.
    if where == "header":
        header = _nested(100_000)
        data = len(header).to_bytes(8, "little") + header
    else:
        data = encode_tensors({"w": np.ones(2, dtype=np.float32)})
        header_len = int.from_bytes(data[:8], "little")
        header = data[8 : 8 + header_len].replace(b'"{}"', b'"' + _nested(100_000) + b'"')
        data = len(header).to_bytes(8, "little") + header + data[8 + header_len :]
    with pytest.raises(TensorBlobError):
        decode_tensors(data)
