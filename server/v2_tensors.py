"""The Open Inference Protocol's (KServe / Triton v2) REST tensors: a request body into named
arrays, scores into a response body (docs/SERVER.md, "The v2 protocol").

    request = parse_infer_request(body, header_length, max_elements=1024 * 4096)
    request.tensors["user"]                     # numpy array, shape as sent
    body, header_length = infer_response(...)  # JSON, or JSON + binary tail

A body is JSON, or with the binary data extension JSON of `Inference-Header-Content-Length`
bytes followed by the inputs' raw bytes in input order, each input saying how many it takes
(`parameters.binary_data_size`). Everything a client sends is checked before an array is
built: a known datatype, a shape of non-negative ints whose product is at most
`max_elements`, `data` holding exactly that many values of the datatype (JSON: flat or nested
as the shape), binary sizes that add up to the tail exactly, BYTES elements (each a 4-byte
little-endian length, then the bytes) that fill their input exactly. A failure is a
`V2RequestError` saying which input and what (a 400 with `{"error": ...}`).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from schemas.errors import BadDataError

#: v2 datatype -> numpy dtype (little-endian); BYTES are object arrays of bytes.
DATATYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
BYTES = "BYTES"
#: the most inputs, and outputs asked for, one request may name.
MAX_TENSORS = 256
#: the longest tensor name.
MAX_NAME = 256
#: the request's JSON, read by msgspec's C decoder: 4.6x json.loads on a batch of 64 examples
#: of 8 inputs (16 vs 74 us). Strict JSON: a NaN or Infinity literal is refused as not JSON (the
#: binary data extension carries NaN).
_JSON = msgspec.json.Decoder()


class V2RequestError(BadDataError):
    """A v2 request that breaks the protocol or the server's limits; the message says where.
    Each kind answers with its own REST status and gRPC status code (by name)."""

    http_status = 400
    grpc_code = "INVALID_ARGUMENT"


class BatchTooLargeError(V2RequestError):
    """More examples than the server's cap."""

    http_status = 413
    grpc_code = "RESOURCE_EXHAUSTED"


class V2NotFoundError(V2RequestError):
    """Another model, or a version that is not the served one."""

    http_status = 404
    grpc_code = "NOT_FOUND"


class V2UnavailableError(V2RequestError):
    """No version is served yet."""

    http_status = 503
    grpc_code = "UNAVAILABLE"


@dataclass(frozen=True)
class InferRequest:
    """A parsed infer request: its named input arrays and what it asks of the response."""

    tensors: dict[str, npt.NDArray[Any]]
    #: the request's `id`, echoed in the response ("" when none).
    id: str = ""
    #: the outputs asked for (None: all) and whether each comes as binary data.
    outputs: dict[str, bool] | None = None
    #: the request-level `binary_data_output` parameter (every output as binary data).
    binary_output: bool = False
    #: the datatype each input was sent as.
    datatypes: dict[str, str] = field(default_factory=dict)


def parse_infer_request(body: bytes, header_length: int | None, max_elements: int) -> InferRequest:
    """The inputs of a v2 REST infer body (see the module docstring); V2RequestError if bad."""
    if header_length is None:
        header, tail = body, b""
    else:
        if not 0 <= header_length <= len(body):
            raise V2RequestError(
                f"Inference-Header-Content-Length {header_length} is not within the body's "
                f"{len(body)} bytes"
            )
        header, tail = body[:header_length], body[header_length:]
    try:
        doc = _JSON.decode(header)
    except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        raise V2RequestError(f"the request is not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise V2RequestError("the request is a JSON object")
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise V2RequestError("the request has `inputs`, a non-empty list")
    if len(inputs) > MAX_TENSORS:
        raise V2RequestError(f"{len(inputs)} inputs; at most {MAX_TENSORS}")
    tensors: dict[str, npt.NDArray[Any]] = {}
    datatypes: dict[str, str] = {}
    at = 0
    for index, entry in enumerate(inputs):
        name, datatype, shape = _header(entry, f"inputs[{index}]", max_elements)
        if name in tensors:
            raise V2RequestError(f"input {name!r} is given twice")
        size = _binary_size(entry, name)
        if size is None:
            if "data" not in entry:
                raise V2RequestError(f"input {name!r} has neither `data` nor binary data")
            array = _from_json(entry["data"], datatype, shape, name)
        else:
            if at + size > len(tail):
                raise V2RequestError(
                    f"input {name!r} says {size} binary bytes, {len(tail) - at} are left"
                )
            array = from_raw(tail[at : at + size], datatype, shape, name)
            at += size
        tensors[name] = array
        datatypes[name] = datatype
    if at != len(tail):
        raise V2RequestError(
            f"the inputs take {at} binary bytes, the body holds {len(tail)} after its header"
        )
    return InferRequest(
        tensors=tensors,
        id=_request_id(doc.get("id")),
        outputs=_outputs(doc.get("outputs")),
        binary_output=_flag(doc.get("parameters"), "binary_data_output"),
        datatypes=datatypes,
    )


def _header(entry: object, where: str, max_elements: int) -> tuple[str, str, tuple[int, ...]]:
    """(name, datatype, shape) of one input entry of a JSON request, checked."""
    if not isinstance(entry, dict):
        raise V2RequestError(f"{where} is an object")
    return check_header(
        entry.get("name"), entry.get("datatype"), entry.get("shape"), where, max_elements
    )


def check_header(
    name: object, datatype: object, shape: object, where: str, max_elements: int
) -> tuple[str, str, tuple[int, ...]]:
    """An input's name, datatype and shape, checked: V2RequestError otherwise (`where` names
    the input when its name is not usable)."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
        raise V2RequestError(f"{where} has a `name` of 1 to {MAX_NAME} characters")
    if not isinstance(datatype, str) or (datatype != BYTES and datatype not in DATATYPES):
        raise V2RequestError(
            f"input {name!r}: datatype {str(datatype)[:32]!r} is not one of the protocol's "
            f"({', '.join([*DATATYPES, BYTES])})"
        )
    if (
        not isinstance(shape, list)
        or not 1 <= len(shape) <= 8
        or not all(type(d) is int and d >= 0 for d in shape)
    ):
        raise V2RequestError(f"input {name!r}: `shape` is a list of 1 to 8 integers >= 0")
    elements = math.prod(shape)
    if elements > max_elements:
        raise V2RequestError(
            f"input {name!r}: shape {shape[:8]} holds {elements} elements; at most {max_elements}"
        )
    return name, datatype, tuple(shape)


def _binary_size(entry: Mapping[str, Any], name: str) -> int | None:
    parameters = entry.get("parameters")
    if parameters is None:
        return None
    if not isinstance(parameters, dict):
        raise V2RequestError(f"input {name!r}: `parameters` is an object")
    size = parameters.get("binary_data_size")
    if size is None:
        return None
    if type(size) is not int or size < 0:
        raise V2RequestError(f"input {name!r}: binary_data_size is an integer >= 0")
    return size


def _from_json(data: object, datatype: str, shape: tuple[int, ...], name: str) -> np.ndarray:
    flat = _flatten(data, name)
    n = math.prod(shape)
    if len(flat) != n:
        raise V2RequestError(
            f"input {name!r}: shape {list(shape)} takes {n} values, got {len(flat)}"
        )
    if datatype == BYTES:
        if not all(isinstance(v, str) for v in flat):
            raise V2RequestError(f"input {name!r}: BYTES data are strings")
        out = np.empty(n, dtype=object)
        out[:] = [v.encode("utf-8", "surrogatepass") for v in flat]
        return out.reshape(shape)
    dtype = DATATYPES[datatype]
    if datatype == "BOOL":
        if not all(isinstance(v, bool) for v in flat):
            raise V2RequestError(f"input {name!r}: BOOL data are true or false")
    elif dtype.kind in "iu":
        if not all(type(v) is int for v in flat):
            raise V2RequestError(f"input {name!r}: {datatype} data are integers")
        info = np.iinfo(dtype)
        if flat and (min(flat) < info.min or max(flat) > info.max):
            raise V2RequestError(f"input {name!r}: a value is outside {datatype}'s range")
    elif not all(type(v) in (int, float) for v in flat):
        raise V2RequestError(f"input {name!r}: {datatype} data are numbers")
    return np.asarray(flat, dtype=dtype).reshape(shape)


def _flatten(data: object, name: str) -> list[Any]:
    """`data` flat (the protocol allows a flat list or one nested as the shape)."""
    if not isinstance(data, list):
        raise V2RequestError(f"input {name!r}: `data` is a list")
    if not any(isinstance(v, list) for v in data):
        return data
    flat: list[Any] = []
    stack: list[Any] = [iter(data)]
    while stack:  # no recursion: a deeply nested body cannot exhaust the stack
        for value in stack[-1]:
            if isinstance(value, list):
                if len(stack) > 8:
                    raise V2RequestError(f"input {name!r}: `data` is nested deeper than a shape")
                stack.append(iter(value))
                break
            flat.append(value)
        else:
            stack.pop()
    return flat


def from_raw(raw: bytes, datatype: str, shape: tuple[int, ...], name: str) -> np.ndarray:
    """An input's array from its raw little-endian bytes (BYTES: length-prefixed elements)."""
    n = math.prod(shape)
    if datatype != BYTES:
        dtype = DATATYPES[datatype]
        if len(raw) != n * dtype.itemsize:
            raise V2RequestError(
                f"input {name!r}: shape {list(shape)} of {datatype} is {n * dtype.itemsize} "
                f"bytes, binary_data_size says {len(raw)}"
            )
        return np.frombuffer(raw, dtype=dtype).reshape(shape)
    out = np.empty(n, dtype=object)
    at = 0
    for i in range(n):
        if at + 4 > len(raw):
            raise V2RequestError(f"input {name!r}: its binary data end inside element {i}")
        (length,) = struct.unpack_from("<I", raw, at)
        at += 4
        if at + length > len(raw):
            raise V2RequestError(
                f"input {name!r}: element {i} says {length} bytes, {len(raw) - at} are left"
            )
        out[i] = raw[at : at + length]
        at += length
    if at != len(raw):
        raise V2RequestError(f"input {name!r}: {len(raw) - at} bytes after its {n} elements")
    return out.reshape(shape)


def _request_id(value: object) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > MAX_NAME:
        raise V2RequestError(f"`id` is a string of at most {MAX_NAME} characters")
    return value


def _flag(parameters: object, key: str) -> bool:
    if parameters is None:
        return False
    if not isinstance(parameters, dict):
        raise V2RequestError("`parameters` is an object")
    value = parameters.get(key, False)
    if not isinstance(value, bool):
        raise V2RequestError(f"parameter {key!r} is true or false")
    return value


def _outputs(value: object) -> dict[str, bool] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > MAX_TENSORS:
        raise V2RequestError(f"`outputs` is a list of at most {MAX_TENSORS}")
    asked: dict[str, bool] = {}
    for index, entry in enumerate(value):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise V2RequestError(f"outputs[{index}] is an object with a `name`")
        asked[entry["name"]] = _flag(entry.get("parameters"), "binary_data")
    return asked


def infer_response(
    *,
    model: str,
    version: int,
    request_id: str,
    outputs: Sequence[tuple[str, npt.NDArray[np.float32]]],
    binary: Mapping[str, bool],
    parameters: Mapping[str, int | str | bool],
) -> tuple[bytes, int | None]:
    """A v2 infer response body and its JSON header's length (None: all JSON): each output in
    JSON `data`, or as raw little-endian bytes after the header where `binary` says so."""
    doc: dict[str, Any] = {
        "model_name": model,
        "model_version": str(version),
        "outputs": [],
    }
    if request_id:
        doc["id"] = request_id
    if parameters:
        doc["parameters"] = dict(parameters)
    tail: list[bytes] = []
    for name, array in outputs:
        out: dict[str, Any] = {"name": name, "datatype": "FP32", "shape": list(array.shape)}
        if binary.get(name, False):
            raw = np.ascontiguousarray(array, dtype="<f4").tobytes()
            out["parameters"] = {"binary_data_size": len(raw)}
            tail.append(raw)
        else:
            out["data"] = array.astype(np.float32).reshape(-1).tolist()
        doc["outputs"].append(out)
    header = json.dumps(doc, separators=(",", ":")).encode()
    if not tail:
        return header, None
    return header + b"".join(tail), len(header)
