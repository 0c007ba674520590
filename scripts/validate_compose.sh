#!/usr/bin/env bash
# Validates compose files against the Compose specification, without Docker.
#
#   scripts/validate_compose.sh [-print] [compose.yaml [override.yaml...]]
#
# Defaults to the repo's compose.yaml. The check is scripts/compose_check, a small
# Go program on compose-go, the loader `docker compose` itself uses: schema,
# interpolation, cross-references, plus "every build context has its Dockerfile"
# and "every pulled image is pinned". compose.yaml gives no secret a default: it
# must refuse to load while they are unset (each named), and load with the ones
# scripts/compose_secrets.sh makes. Exits non-zero on the first invalid file.
# The binary is built once (Go module proxy) and cached by source hash.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
readonly SCRIPT_DIR
readonly REPO_ROOT=${SCRIPT_DIR%/scripts}
readonly CACHE=${CHECKNRUN_CACHE:-$HOME/.cache/checknrun}
readonly SRC=$SCRIPT_DIR/compose_check

log() { printf 'validate_compose: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

build_checker() {
  local hash
  hash=$(cat "$SRC/go.mod" "$SRC/go.sum" "$SRC"/*.go | sha256sum | cut -c1-16)
  CHECKER=$CACHE/compose-check/$hash/compose-check
  [[ -x $CHECKER ]] && return 0
  command -v go >/dev/null 2>&1 || die "'go' is not installed; it is needed to build $SRC"
  log "building compose-check with Go (first run only, ~1 min)..."
  mkdir -p "$(dirname "$CHECKER")"
  # -mod=readonly: go.sum is the lock file; a build must not rewrite it.
  (cd "$SRC" && GOCACHE=$CACHE/go/build GOMODCACHE=$CACHE/go/mod GOFLAGS=-mod=readonly \
    go build -o "$CHECKER.tmp" .) || die "building compose-check failed (see above)"
  mv "$CHECKER.tmp" "$CHECKER"
}

main() {
  local args=() files=0 arg
  for arg in "$@"; do
    [[ $arg == -* ]] || files=$((files + 1))
    args+=("$arg")
  done
  ((files > 0)) || args+=("$REPO_ROOT/compose.yaml")
  build_checker
  local secrets names out name
  secrets=$(bash "$SCRIPT_DIR/compose_secrets.sh")
  names=$(sed 's/=.*//' <<<"$secrets")
  if [[ -e $REPO_ROOT/.env ]]; then
    log "a .env file is there: not checking that the secrets are required"
  else
    # shellcheck disable=SC2046  # one -u NAME per secret
    if out=$(env $(sed 's/^/-u /' <<<"$names") "$CHECKER" "${args[@]}" 2>&1); then
      die "the compose files load with their secrets unset: give each \${NAME:?...}"
    fi
    for name in $names; do
      grep -q "required variable $name is missing" <<<"$out" || die "$name is not required"
    done
  fi
  # shellcheck disable=SC2046  # one NAME=VALUE per secret, all letters and digits
  env $secrets "$CHECKER" "${args[@]}"
}

main "$@"
