"""The Open Inference Protocol v2 over REST (server/routes/v2.py) and gRPC (server/grpc_v2/) on
a model trained from raw events: health and metadata, infer in JSON, with the binary data
extension and over gRPC scoring as /v1/predict does, a version's own endpoint, and every
hostile body a typed 4xx or gRPC status. Triton's own clients: test_v2_clients.py."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest

from server.grpc_v2 import inference_pb2 as pb
from server.grpc_v2.service import METHODS, SERVICE
from tests.unit.server.test_raw_id_api import TS, RawServed, served

__all__ = ["served"]  # the fixture, shared with the /v1 raw-id tests

INFER = "/v2/models/m/infer"
NAN = float("nan")
ASKED = [
    {"user": "u3", "item": 2, "genres": ["Drama"], "ts": TS, "price": 12.5},
    {"user": "stranger", "item": "2", "genres": ["Drama", "Western"], "ts": TS},
    {"item": 1, "ts": TS},
]


def _inputs() -> list[dict[str, Any]]:
    """ASKED as v2 tensors."""
    return [
        {"name": "user", "datatype": "BYTES", "shape": [3], "data": ["u3", "stranger", ""]},
        {"name": "item", "datatype": "BYTES", "shape": [3, 1], "data": [["2"], ["2"], ["1"]]},
        {
            "name": "genres",
            "datatype": "BYTES",
            "shape": [3],
            "data": ["Drama", "Drama", "Western"],
        },
        {"name": "genres_lengths", "datatype": "INT64", "shape": [3], "data": [1, 2, 0]},
        {
            "name": "price",
            "datatype": "FP32",
            "shape": [3],
            "data": [12.5, float("nan"), float("nan")],
        },
        {"name": "ts", "datatype": "FP64", "shape": [3], "data": [TS, TS, TS]},
    ]


def _json_inputs() -> list[dict[str, Any]]:
    inputs = _inputs()
    inputs[4] = {"name": "price", "datatype": "FP32", "shape": [2], "data": [12.5, 3.0]}
    return [i for i in inputs if i["name"] not in ("price", "ts")]


def _bytes(values: list[str]) -> bytes:
    return b"".join(struct.pack("<I", len(v.encode())) + v.encode() for v in values)


def test_health_and_metadata(served: RawServed) -> None:
    client = served.client
    assert client.get("/v2/health/live").status_code == 200
    assert client.get("/v2/health/ready").status_code == 200
    assert client.get("/v2/models/m/ready").status_code == 200
    assert client.get("/v2").json()["extensions"] == ["binary_tensor_data"]
    meta = client.get("/v2/models/m").json()
    assert meta["versions"] == ["1"] and meta["outputs"][0]["name"] == "score"
    types = {t["name"]: t["datatype"] for t in meta["inputs"]}
    assert types == {
        "user": "BYTES",
        "item": "BYTES",
        "genres": "BYTES",
        "genres_lengths": "INT64",
        "price": "FP32",
        "ts": "FP64",
    }
    r = client.get("/v2/models/other")
    assert r.status_code == 404 and "serves 'm'" in r.json()["error"]


def test_infer_scores_as_v1_predict_does(served: RawServed) -> None:
    v1 = served.predict(*ASKED).json()
    body = {"id": "req-7", "inputs": _inputs()}
    # NaN is not JSON: the JSON form sends the price of the one example that has it as binary
    # elsewhere; here every input but price and ts, in JSON, against v1 without them
    plain = [{k: v for k, v in e.items() if k not in ("price", "ts")} for e in ASKED]
    expected = served.predict(*plain).json()
    r = served.client.post(INFER, json={"id": "req-7", "inputs": _json_inputs()})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["id"] == "req-7" and doc["model_name"] == "m" and doc["model_version"] == "1"
    (out,) = doc["outputs"]
    assert out["name"] == "score" and out["datatype"] == "FP32" and out["shape"] == [3]
    np.testing.assert_allclose(out["data"], expected["scores"], atol=1e-6)
    assert doc["parameters"] == {
        "track": "released",
        "unknown_ids_user": 2,
        "unknown_ids_item": 0,
        "unknown_ids_genres": 1,
    }

    # the binary data extension: every input's raw bytes after the JSON header, NaN: missing
    header: dict[str, Any] = {
        "inputs": [],
        "outputs": [{"name": "score", "parameters": {"binary_data": True}}],
    }
    tail = b""
    for tensor in body["inputs"]:
        if tensor["datatype"] == "BYTES":
            flat = np.asarray(tensor["data"], dtype=object).reshape(-1).tolist()
            raw = _bytes(flat)
        else:
            dtype = {"INT64": "<i8", "FP32": "<f4", "FP64": "<f8"}[tensor["datatype"]]
            raw = np.asarray(tensor["data"], dtype=dtype).tobytes()
        header["inputs"].append(
            {k: tensor[k] for k in ("name", "datatype", "shape")}
            | {"parameters": {"binary_data_size": len(raw)}}
        )
        tail += raw
    head = json.dumps(header).encode()
    r = served.client.post(
        INFER,
        content=head + tail,
        headers={
            "Inference-Header-Content-Length": str(len(head)),
            "Content-Type": "application/octet-stream",
        },
    )
    assert r.status_code == 200, r.text
    length = int(r.headers["Inference-Header-Content-Length"])
    doc = json.loads(r.content[:length])
    (out,) = doc["outputs"]
    assert out["parameters"]["binary_data_size"] == 12
    scores = np.frombuffer(r.content[length:], dtype="<f4")
    np.testing.assert_allclose(scores, v1["scores"], atol=1e-6)


def test_a_versions_endpoint_answers_for_that_version_only(served: RawServed) -> None:
    body = {"inputs": _json_inputs()}
    assert served.client.post("/v2/models/m/versions/1/infer", json=body).status_code == 200
    r = served.client.post("/v2/models/m/versions/7/infer", json=body)
    assert r.status_code == 404 and "version 7 is not served" in r.json()["error"]
    assert served.client.post("/v2/models/m/versions/x/infer", json=body).status_code == 400
    assert served.client.post("/v2/models/other/infer", json=body).status_code == 404


def _user(**change: Any) -> dict[str, Any]:
    return {"name": "user", "datatype": "BYTES", "shape": [1], "data": ["u1"]} | change


@pytest.mark.parametrize(
    ("body", "headers", "status", "message"),
    [
        (b"{not json", {}, 400, "not JSON"),
        (b'{"inputs": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", {}, 400, "not JSON"),
        (b'{"inputs": [{"name": "price", "data": [1e400]}]}', {}, 400, "not JSON"),
        (b'{"inputs": [{"name": "price", "data": [NaN]}]}', {}, 400, "not JSON"),
        (json.dumps({"inputs": []}).encode(), {}, 400, "non-empty list"),
        (json.dumps({"inputs": [_user(datatype="FP128")]}).encode(), {}, 400, "not one of"),
        (json.dumps({"inputs": [_user(shape=[2])]}).encode(), {}, 400, "takes 2 values, got 1"),
        (json.dumps({"inputs": [_user(shape=[10**12])]}).encode(), {}, 400, "at most"),
        (json.dumps({"inputs": [_user(shape=[-1])]}).encode(), {}, 400, "integers >= 0"),
        (json.dumps({"inputs": [_user(data=[7])]}).encode(), {}, 400, "BYTES data are strings"),
        (json.dumps({"inputs": [_user(datatype="FP32", data=[1.5])]}).encode(), {}, 400, "user"),
        (json.dumps({"inputs": [_user(), _user()]}).encode(), {}, 400, "given twice"),
        (
            json.dumps({"inputs": [_user(shape=[17], data=["u"] * 17)]}).encode(),
            {},
            413,
            "exceeds the cap of 16",
        ),
        (
            json.dumps(
                {
                    "inputs": [
                        {"name": "genres", "datatype": "BYTES", "shape": [1], "data": ["Drama"]},
                        {"name": "genres_lengths", "datatype": "INT64", "shape": [1], "data": [3]},
                    ]
                }
            ).encode(),
            {},
            400,
            "add up to 3",
        ),
        (
            json.dumps(
                {"inputs": [_user(shape=[1], data=None, parameters={"binary_data_size": 99})]}
            ).encode()
            + _bytes(["u1"]),
            {"Inference-Header-Content-Length": "LEN"},
            400,
            "says 99 binary bytes",
        ),
        (
            json.dumps(
                {"inputs": [_user(shape=[1], data=None, parameters={"binary_data_size": 6})]}
            ).encode()
            + _bytes(["u1"])
            + b"extra",
            {"Inference-Header-Content-Length": "LEN"},
            400,
            "the body holds 11",
        ),
        (
            json.dumps(
                {"inputs": [_user(shape=[1], data=None, parameters={"binary_data_size": 6})]}
            ).encode()
            + struct.pack("<I", 1000)
            + b"u1",
            {"Inference-Header-Content-Length": "LEN"},
            400,
            "element 0 says 1000 bytes",
        ),
        (
            json.dumps({"inputs": [_user()]}).encode(),
            {"Inference-Header-Content-Length": "999999"},
            400,
            "not within",
        ),
        (
            json.dumps({"inputs": [_user()]}).encode(),
            {"Inference-Header-Content-Length": "-3"},
            400,
            "byte count",
        ),
        (
            json.dumps({"inputs": [_user()], "outputs": [{"name": "logits"}]}).encode(),
            {},
            400,
            "unknown outputs",
        ),
    ],
)
def test_hostile_v2_bodies_are_typed_4xx(
    served: RawServed, body: bytes, headers: dict[str, str], status: int, message: str
) -> None:
    if headers.get("Inference-Header-Content-Length") == "LEN":
        head = body.split(b"}]}", 1)[0] + b"}]}"
        headers = {"Inference-Header-Content-Length": str(len(head))}
    r = served.client.post(INFER, content=body, headers=headers)
    assert r.status_code == status, r.text
    assert message in r.json()["error"], r.json()
    assert served.client.get("/v2/health/live").status_code == 200  # nothing lost: it serves on


class _Stub:
    """The protocol's service on a channel, as any gRPC client calls it: by method path."""

    def __init__(self, channel: grpc.Channel) -> None:
        for name, (request, response) in METHODS.items():
            call = channel.unary_unary(
                f"/{SERVICE}/{name}",
                request_serializer=request.SerializeToString,
                response_deserializer=response.FromString,
            )
            setattr(self, name, call)

    def __getattr__(self, name: str) -> Any:  # the methods set above
        raise AttributeError(name)


def _stub(served: RawServed) -> tuple[grpc.Channel, Any]:
    channel = grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}")
    return channel, _Stub(channel)


def test_grpc_infers_as_v1_predict_does(served: RawServed) -> None:
    want = served.predict({"user": "u3", "item": 2, "ts": TS}, {"user": "zz", "item": 1, "ts": TS})
    tensor = pb.ModelInferRequest.InferInputTensor
    request = pb.ModelInferRequest(
        model_name="m",
        model_version="1",
        id="g7",
        inputs=[
            tensor(
                name="user",
                datatype="BYTES",
                shape=[2],
                contents=pb.InferTensorContents(bytes_contents=[b"u3", b"zz"]),
            ),
            tensor(
                name="item",
                datatype="INT64",
                shape=[2],
                contents=pb.InferTensorContents(int64_contents=[2, 1]),
            ),
            tensor(
                name="ts",
                datatype="FP64",
                shape=[2],
                contents=pb.InferTensorContents(fp64_contents=[TS, TS]),
            ),
        ],
    )
    channel, stub = _stub(served)
    with channel:
        assert stub.ServerReady(pb.ServerReadyRequest(), timeout=10).ready
        meta = stub.ModelMetadata(pb.ModelMetadataRequest(name="m"), timeout=10)
        assert list(meta.versions) == ["1"] and meta.outputs[0].name == "score"
        response = stub.ModelInfer(request, timeout=10)
    assert response.model_version == "1" and response.id == "g7"
    scores = np.frombuffer(response.raw_output_contents[0], dtype="<f4")
    np.testing.assert_allclose(scores, want.json()["scores"], atol=1e-6)
    assert response.parameters["unknown_ids_user"].int64_param == 1


def _raw_request(raw: list[bytes], **tensor: object) -> object:
    spec = {"name": "user", "datatype": "BYTES", "shape": [1]} | tensor
    return pb.ModelInferRequest(
        model_name="m",
        inputs=[pb.ModelInferRequest.InferInputTensor(**spec)],  # type: ignore[arg-type]
        raw_input_contents=raw,
    )


def _contents_request(**contents: object) -> object:
    tensor = pb.ModelInferRequest.InferInputTensor(
        name="user",
        datatype="INT8",
        shape=[1],
        contents=pb.InferTensorContents(**contents),  # type: ignore[arg-type]
    )
    return pb.ModelInferRequest(model_name="m", inputs=[tensor])


@pytest.mark.parametrize(
    ("request_of", "code", "message"),
    [
        (lambda: _raw_request([b"\x05\x00\x00\x00u1"]), "INVALID_ARGUMENT", "says 5 bytes"),
        (lambda: _raw_request([b"\x02\x00\x00\x00u1", b"x"]), "INVALID_ARGUMENT", "2 entries"),
        (lambda: _raw_request([b""], shape=[10**12]), "INVALID_ARGUMENT", "at most"),
        (
            lambda: _raw_request([b"\x00" * 4], datatype="FP32", shape=[2]),
            "INVALID_ARGUMENT",
            "8 bytes",
        ),
        (lambda: _raw_request([b""], datatype="COMPLEX"), "INVALID_ARGUMENT", "not one of"),
        (lambda: _contents_request(int_contents=[300]), "INVALID_ARGUMENT", "INT8's range"),
        (lambda: _contents_request(int_contents=[1, 2]), "INVALID_ARGUMENT", "takes 1 values"),
        (
            lambda: _raw_request([b"".join(b"\x01\x00\x00\x00u" for _ in range(17))], shape=[17]),
            "RESOURCE_EXHAUSTED",
            "exceeds the cap",
        ),
        (lambda: pb.ModelInferRequest(model_name="m"), "INVALID_ARGUMENT", "no input"),
        (lambda: pb.ModelInferRequest(model_name="x"), "NOT_FOUND", "unknown model"),
        (
            lambda: pb.ModelInferRequest(model_name="m", model_version="v1"),
            "INVALID_ARGUMENT",
            "not a version number",
        ),
    ],
)
def test_hostile_grpc_requests_are_statuses(
    served: RawServed, request_of: Callable[[], object], code: str, message: str
) -> None:
    channel, stub = _stub(served)
    with channel:
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request_of(), timeout=10)
        error: grpc.Call = info.value  # type: ignore[assignment]
        assert error.code().name == code, error.details()
        assert message in (error.details() or "")
        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=10).live  # it serves on
