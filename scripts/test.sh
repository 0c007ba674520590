#!/usr/bin/env bash
# The whole test suite: install, start the real Kafka + MinIO on loopback, lint, type-check,
# then every test (unit, integration, fault) and the benchmark machinery in quick mode.
#
#   bash scripts/test.sh                      everything, as CI runs it (.ci/run)
#   bash scripts/test.sh --tier quick         one tier's tests only: quick, slow, integration or
#                                             system (tests/conftest.py says what each holds);
#                                             only `integration` starts Kafka + MinIO
#   bash scripts/test.sh [--tier T] ARGS...   extra arguments go to pytest (e.g. `-k store`)
set -euo pipefail
cd "$(dirname "$0")/.."

tier=""  # none: everything
if [ "${1:-}" = --tier ]; then
  tier="${2:-}"
  shift $(( $# < 2 ? $# : 2 ))
  [ -n "$tier" ] || tier="(none)"
elif [[ "${1:-}" == --tier=* ]]; then
  tier="${1#--tier=}"
  shift
  [ -n "$tier" ] || tier="(none)"
fi
case "$tier" in
  "" | quick | slow | integration | system) ;;
  *) echo "test.sh: --tier takes quick, slow, integration or system, not $tier" >&2; exit 2 ;;
esac

VENV="$(bash scripts/setup.sh)"
export PATH="$VENV/bin:$PATH"

if [ -z "$tier" ] || [ "$tier" = integration ]; then
  echo "== services (Kafka 4 KRaft + MinIO, loopback)"
  eval "$(bash scripts/services.sh up)"
  if [ "${CHECKNRUN_KEEP_SERVICES:-0}" != 1 ]; then
    trap 'bash scripts/services.sh down >/dev/null 2>&1 || true' EXIT
  fi
fi

if [ -z "$tier" ]; then
  echo "== lint and types"
  ruff check .
  ruff format --check .
  mypy

  echo "== compose file"
  bash scripts/validate_compose.sh
fi

echo "== tests${tier:+ (tier $tier)}"
python -m pytest ${tier:+--tier "$tier"} "$@"
