"""The Open Inference Protocol v2 over gRPC (`inference.GRPCInferenceService`, the protocol's
service; its messages in `inference.proto` here), served beside the REST API with `--grpc-port`.

    server = start_grpc(state, "127.0.0.1", 8001)   # a grpc.Server, in its own threads
    ...
    server.stop(grace=1.0)

Infer is server/v2_infer.py's, as over REST: an input's values come in the contents field of
its datatype or, for every input at once, in `raw_input_contents` (each input's raw
little-endian bytes; BYTES length-prefixed), checked as the REST body is (server/v2_tensors.py:
datatype, shape within the cap, values filling it exactly) before an array is built; scores go
back in `raw_output_contents`. A request is at most `max_body_bytes` (gRPC's own receive limit).
Errors are gRPC statuses: INVALID_ARGUMENT (a request that breaks the protocol or the model's
inputs), NOT_FOUND (another model, a version not served), RESOURCE_EXHAUSTED (a batch over the
cap), UNAVAILABLE (no version yet).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np

from server.dependencies import ServerState
from server.grpc_v2 import inference_pb2 as pb
from server.routes.v2 import SERVER_METADATA
from server.v2_infer import (
    SCORE,
    check_model,
    check_outputs,
    infer,
    is_ready,
    max_elements,
    model_metadata,
)
from server.v2_tensors import (
    BYTES,
    DATATYPES,
    MAX_TENSORS,
    V2RequestError,
    check_header,
    from_raw,
)

#: the contents field of each datatype (FP16 comes raw only).
CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    BYTES: "bytes_contents",
}
#: threads answering gRPC calls.
GRPC_THREADS = 4


#: the protocol's service name: clients call `/inference.GRPCInferenceService/<Method>`.
SERVICE = "inference.GRPCInferenceService"


class InferenceService:
    """The v2 service over the app's state (its served model and predictor)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def ServerLive(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.ServerReadyResponse(ready=is_ready(self.state))

    def ModelReady(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._guard(context, check_model, self.state, request.name)
        return pb.ModelReadyResponse(ready=is_ready(self.state))

    def ServerMetadata(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.ServerMetadataResponse(**SERVER_METADATA)

    def ModelMetadata(self, request: Any, context: grpc.ServicerContext) -> Any:
        meta = self._guard(context, model_metadata, self.state, request.name)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=meta["name"],
            versions=meta["versions"],
            platform=meta["platform"],
            inputs=[tensor(**t) for t in meta["inputs"]],
            outputs=[tensor(**t) for t in meta["outputs"]],
        )

    def ModelInfer(self, request: Any, context: grpc.ServicerContext) -> Any:
        outcome = self._guard(context, self._infer, request)
        scores = np.ascontiguousarray(outcome.scores, dtype="<f4")
        response = pb.ModelInferResponse(
            model_name=request.model_name,
            model_version=str(outcome.version),
            id=request.id,
            outputs=[
                pb.ModelInferResponse.InferOutputTensor(
                    name=SCORE, datatype="FP32", shape=[len(scores)]
                )
            ],
            raw_output_contents=[scores.tobytes()],
        )
        for key, value in outcome.parameters.items():
            if isinstance(value, str):
                response.parameters[key].string_param = value
            else:
                response.parameters[key].int64_param = value
        return response

    def _infer(self, request: Any) -> Any:
        check_model(self.state, request.model_name)
        version = request.model_version
        if version and (not version.isdigit() or len(version) > 12):
            raise V2RequestError(f"version {version[:16]!r} is not a version number")
        check_outputs({o.name: True for o in request.outputs} or None)
        tensors = request_tensors(request, max_elements(self.state))
        return infer(self.state, request.model_name, int(version) if version else None, tensors)

    @staticmethod
    def _guard(context: grpc.ServicerContext, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except V2RequestError as exc:
            context.abort(grpc.StatusCode[exc.grpc_code], str(exc))


def request_tensors(request: Any, max_elements: int) -> dict[str, np.ndarray]:
    """The input arrays of a ModelInferRequest, checked (see the module docstring)."""
    inputs = request.inputs
    if not inputs:
        raise V2RequestError("the request has no input")
    if len(inputs) > MAX_TENSORS:
        raise V2RequestError(f"{len(inputs)} inputs; at most {MAX_TENSORS}")
    raw = request.raw_input_contents
    if raw and len(raw) != len(inputs):
        raise V2RequestError(
            f"raw_input_contents holds {len(raw)} entries for {len(inputs)} inputs"
        )
    tensors: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(inputs):
        name, datatype, shape = check_header(
            tensor.name, tensor.datatype, list(tensor.shape), f"inputs[{index}]", max_elements
        )
        if name in tensors:
            raise V2RequestError(f"input {name!r} is given twice")
        if raw:
            tensors[name] = from_raw(raw[index], datatype, shape, name)
        else:
            tensors[name] = _from_contents(tensor, datatype, shape, name)
    return tensors


def _from_contents(tensor: Any, datatype: str, shape: tuple[int, ...], name: str) -> np.ndarray:
    field = CONTENTS.get(datatype)
    if field is None:
        raise V2RequestError(f"input {name!r}: {datatype} comes in raw_input_contents only")
    values = getattr(tensor.contents, field)
    n = math.prod(shape)
    if len(values) != n:
        raise V2RequestError(
            f"input {name!r}: shape {list(shape)} takes {n} values, {field} holds {len(values)}"
        )
    if datatype == BYTES:
        out = np.empty(n, dtype=object)
        out[:] = list(values)
        return out.reshape(shape)
    dtype = DATATYPES[datatype]
    wide = dtype.kind in "iu" and dtype != np.uint64  # int32/uint32/int64 fields: checked below
    array = np.asarray(values, dtype=np.int64 if wide else dtype)
    if wide and n:
        info = np.iinfo(dtype)
        if int(array.min()) < info.min or int(array.max()) > info.max:
            raise V2RequestError(f"input {name!r}: a value is outside {datatype}'s range")
    return array.astype(dtype).reshape(shape)


#: method -> (request message, response message).
METHODS: dict[str, tuple[Any, Any]] = {
    "ServerLive": (pb.ServerLiveRequest, pb.ServerLiveResponse),
    "ServerReady": (pb.ServerReadyRequest, pb.ServerReadyResponse),
    "ModelReady": (pb.ModelReadyRequest, pb.ModelReadyResponse),
    "ServerMetadata": (pb.ServerMetadataRequest, pb.ServerMetadataResponse),
    "ModelMetadata": (pb.ModelMetadataRequest, pb.ModelMetadataResponse),
    "ModelInfer": (pb.ModelInferRequest, pb.ModelInferResponse),
}


def service_handler(service: InferenceService) -> grpc.GenericRpcHandler:
    """`service`'s methods under the protocol's service name, unary each."""
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(service, name),
            request_deserializer=request.FromString,
            response_serializer=response.SerializeToString,
        )
        for name, (request, response) in METHODS.items()
    }
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


def start_grpc(state: ServerState, host: str, port: int) -> tuple[grpc.Server, int]:
    """The v2 gRPC server on `host:port` (0: any free port), started; and the port bound.

    The port is bound without SO_REUSEPORT (a port in use is an error, not silently shared)
    except under `--workers`, whose processes all bind it (the kernel spreads connections)."""
    server = grpc.server(
        ThreadPoolExecutor(max_workers=GRPC_THREADS, thread_name_prefix="grpc-v2"),
        options=[
            ("grpc.max_receive_message_length", state.settings.max_body_bytes),
            ("grpc.so_reuseport", int(state.settings.workers > 1)),
        ],
    )
    server.add_generic_rpc_handlers((service_handler(InferenceService(state)),))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"gRPC: cannot bind {host}:{port}")
    server.start()
    return server, bound
