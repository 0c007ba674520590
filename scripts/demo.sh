#!/usr/bin/env bash
# The main job on the embedded default: install (cached under ~/.cache/checknrun), then train on
# MovieLens-1M online while a live server follows the published versions. Extra arguments go to
# `checknrun demo` (e.g. `bash scripts/demo.sh --max-samples 1000209` for the whole stream).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(bash scripts/setup.sh)"
exec "$VENV/bin/checknrun" demo "$@"
