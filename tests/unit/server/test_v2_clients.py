"""The v2 protocol with Triton's own clients (`tritonclient.http`, `tritonclient.grpc`) against a
real `checknrun serve --grpc-port` process: health, metadata, infer in JSON and binary tensors
scoring as /v1/predict does, and a version's own infer (hostile requests: test_v2_protocol.py)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from bench.child_server import ChildServer, free_port
from bench.synthetic_live import SyntheticLiveRun
from publisher.store import FileStore
from tests.unit.server.test_raw_id_api import SPEC, TS, train

pytestmark = pytest.mark.slow  # a server process

USERS = np.array([b"u3", b"stranger", b""], dtype=object)
ITEMS = np.array([[b"2"], [b"2"], [b"1"]], dtype=object)
GENRES = np.array([b"Drama", b"Drama", b"Western"], dtype=object)
LENGTHS = np.array([1, 2, 0], dtype=np.int64)
PRICE = np.array([12.5, np.nan, np.nan], dtype=np.float32)
TIMES = np.full(3, TS, dtype=np.float64)
EXAMPLES = [
    {"user": "u3", "item": "2", "genres": ["Drama"], "price": 12.5, "ts": TS},
    {"user": "stranger", "item": "2", "genres": ["Drama", "Western"], "ts": TS},
    {"item": "1", "ts": TS},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ChildServer, int]]:
    root = tmp_path_factory.mktemp("v2")
    run = SyntheticLiveRun(FileStore(root / "store"), "m", spec=SPEC)
    train(run, [f"u{i}" for i in range(10)])
    run.publish()
    run.close()
    grpc_port = free_port()
    with ChildServer(
        f"file://{root / 'store'}",
        "m",
        root / "serve.log",
        grpc_port=str(grpc_port),
        poll_head_after="0.5",
    ) as child:
        child.wait_ready()
        yield child, grpc_port


def _inputs(module: object, binary: bool) -> list[object]:
    made = []
    for name, array, datatype in (
        ("user", USERS, "BYTES"),
        ("item", ITEMS, "BYTES"),
        ("genres", GENRES, "BYTES"),
        ("genres_lengths", LENGTHS, "INT64"),
        ("price", PRICE, "FP32"),
        ("ts", TIMES, "FP64"),
    ):
        tensor = module.InferInput(name, list(array.shape), datatype)  # type: ignore[attr-defined]
        if module is triton_http:
            tensor.set_data_from_numpy(array, binary_data=binary)
        else:
            tensor.set_data_from_numpy(array)
        made.append(tensor)
    return made


def test_tritonclient_http_health_metadata_and_infer(server: tuple[ChildServer, int]) -> None:
    child, _ = server
    expected = child.client.post("/v1/predict", json={"examples": EXAMPLES}).json()["scores"]
    client = triton_http.InferenceServerClient(url=child.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("m")
    meta = client.get_model_metadata("m")
    assert meta["versions"] == ["1"] and meta["outputs"][0]["name"] == "score"
    for binary in (True, False):
        if not binary:  # NaN is not JSON: a JSON body leaves out the price
            inputs = [t for t in _inputs(triton_http, False) if t.name() != "price"]
            plain = [{k: v for k, v in e.items() if k != "price"} for e in EXAMPLES]
            want = child.client.post("/v1/predict", json={"examples": plain}).json()["scores"]
        else:
            inputs, want = _inputs(triton_http, True), expected
        asked = [triton_http.InferRequestedOutput("score", binary_data=binary)]
        result = client.infer("m", inputs, outputs=asked, request_id="r1")
        np.testing.assert_allclose(result.as_numpy("score"), want, atol=1e-6)
        response = result.get_response()
        assert response["model_version"] == "1" and response["id"] == "r1"
        assert response["parameters"]["unknown_ids_user"] == 2
    with pytest.raises(InferenceServerException, match="version 9 is not served"):
        client.infer("m", _inputs(triton_http, True), model_version="9")
    client.close()


def test_tritonclient_grpc_health_metadata_and_infer(server: tuple[ChildServer, int]) -> None:
    child, grpc_port = server
    expected = child.client.post("/v1/predict", json={"examples": EXAMPLES}).json()["scores"]
    client = triton_grpc.InferenceServerClient(url=f"127.0.0.1:{grpc_port}")
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("m")
    meta = client.get_model_metadata("m", as_json=True)
    assert meta["versions"] == ["1"]
    assert {t["name"]: t["datatype"] for t in meta["inputs"]}["genres_lengths"] == "INT64"
    assert client.get_server_metadata(as_json=True)["extensions"] == ["binary_tensor_data"]
    result = client.infer("m", _inputs(triton_grpc, True), model_version="1", request_id="g1")
    np.testing.assert_allclose(result.as_numpy("score"), expected, atol=1e-6)
    response = result.get_response(as_json=True)
    assert response["model_version"] == "1" and response["id"] == "g1"
    with pytest.raises(InferenceServerException, match="version 9 is not served") as info:
        client.infer("m", _inputs(triton_grpc, True), model_version="9")
    assert info.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException, match="unknown model") as info:
        client.infer("other", _inputs(triton_grpc, True))
    assert info.value.status() == "StatusCode.NOT_FOUND"
    client.close()
