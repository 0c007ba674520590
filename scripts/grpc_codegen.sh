#!/usr/bin/env bash
# Regenerate server/grpc_v2/inference_pb2.py{,i} (committed) from inference.proto, with a
# pinned grpcio-tools in a scratch virtualenv of its own (not a dependency of the project):
# 1.75 writes protobuf 6.31 code, which runs on protobuf 6 (tritonclient[grpc] needs < 7) and 7.
set -euo pipefail
cd "$(dirname "$0")/.."
tools="${CHECKNRUN_CACHE:-$HOME/.cache/checknrun}/grpc-tools"
if [ ! -x "$tools/bin/python" ]; then
  python3 -m venv "$tools"
  "$tools/bin/pip" install -q "grpcio-tools==1.75.1"
fi
"$tools/bin/python" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. server/grpc_v2/inference.proto
echo "generated server/grpc_v2/inference_pb2.py and inference_pb2.pyi" >&2
