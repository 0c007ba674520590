#!/usr/bin/env bash
# The prepared GPU check (bench/gpu_check.py): train, publish, restore, next to torch.save; ~5 min.
set -euo pipefail
cd "$(dirname "$0")/.." && VENV="$(bash scripts/setup.sh)" && export PATH="$VENV/bin:$PATH"
python -m bench.gpu_check --device cuda --out "${OUT:-/tmp/gpu_check}" "$@"
