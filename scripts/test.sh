#!/usr/bin/env bash
# The whole test suite: install, start the real Kafka + MinIO on loopback, lint, type-check,
# then every test (unit, integration, fault) and the benchmark machinery in quick mode.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k store`).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(bash scripts/setup.sh)"
export PATH="$VENV/bin:$PATH"

echo "== services (Kafka 4 KRaft + MinIO, loopback)"
eval "$(bash scripts/services.sh up)"
if [ "${CHECKNRUN_KEEP_SERVICES:-0}" != 1 ]; then
  trap 'bash scripts/services.sh down >/dev/null 2>&1 || true' EXIT
fi

echo "== lint and types"
ruff check .
ruff format --check .
mypy

echo "== compose file"
bash scripts/validate_compose.sh

echo "== tests"
python -m pytest "$@"
