#!/usr/bin/env bash
# Runs compose.yaml for real on a machine that reaches no container registry (CI):
# a private Docker engine, local images, and Compose v2 with compose.ci.yaml.
#
#   scripts/compose_stack.sh prepare          engine up, images built (cached), print the env file
#   scripts/compose_stack.sh compose ARGS...  docker compose -f compose.yaml -f compose.ci.yaml ARGS
#   scripts/compose_stack.sh env              print the env file of the last prepare
#   scripts/compose_stack.sh engine-status    exit 0 only if the engine runs
#   scripts/compose_stack.sh engine-down      stop the engine (refused while containers run)
#
# Typical use:  eval "$(scripts/compose_stack.sh prepare)"; scripts/compose_stack.sh compose up -d
#
# The engine is Debian's docker.io (installed with apt-get when missing), started
# as a plain root process with its own data root, exec root, pidfile and socket
# under $CHECKNRUN_CACHE/docker, with --bridge=none --iptables=false: containers
# use the host network only (compose.ci.yaml), so it creates no bridge, rule or
# route. It is never the machine's own dockerd, and engine-down stops only it.
#
# Images, each cached (a second prepare takes seconds):
# - checknrun-ci/base:bookworm: `debootstrap --variant=minbase bookworm` with
#   python3 and a venv on PATH, imported with `docker import`; rebuilt when its
#   recipe (below) changes;
# - checknrun-ci/kafka:4.1.1 and checknrun-ci/minio:local (scripts/ci_images/) from
#   the Kafka jars and MinIO binary scripts/services.sh fetches and builds, plus mc,
#   built here with the Go module proxy;
# - checknrun:local from the Dockerfile, on the base image, torch from the
#   machine's pip index, the machine's CA bundle as a build secret.
# Compose is v2, built from its Go module (the registries ship no binary of it).
#
# Knobs (environment): CHECKNRUN_CACHE (default ~/.cache/checknrun),
# CHECKNRUN_DEBIAN_MIRROR (default http://deb.debian.org/debian),
# CHECKNRUN_ENGINE_TIMEOUT (engine start wait, default 60 s).
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
readonly SCRIPT_DIR
readonly REPO_ROOT=${SCRIPT_DIR%/scripts}
readonly CACHE=${CHECKNRUN_CACHE:-$HOME/.cache/checknrun}
readonly ENGINE_DIR=$CACHE/docker
readonly SOCKET=$ENGINE_DIR/docker.sock
readonly ENGINE_PIDFILE=$ENGINE_DIR/dockerd.pid
readonly STACK_DIR=$CACHE/compose-stack
readonly ENV_FILE=$STACK_DIR/env
readonly ENGINE_TIMEOUT=${CHECKNRUN_ENGINE_TIMEOUT:-60}
readonly PROJECT=checknrun-ci
readonly BUILD_CACHE_KEEP=10GB

readonly COMPOSE_VERSION=v2.40.3
readonly COMPOSE_BIN=$CACHE/compose-cli/$COMPOSE_VERSION/docker-compose
# The mc that MinIO's own go.mod requires (scripts/services.sh pins MinIO): an
# admin client and server of the same vintage.
readonly MC_VERSION=v0.0.0-20250313080218-cf909e1063a9
readonly MC_BIN=$CACHE/mc/$MC_VERSION/mc

readonly BASE_IMAGE=checknrun-ci/base:bookworm
readonly MIRROR=${CHECKNRUN_DEBIAN_MIRROR:-http://deb.debian.org/debian}
readonly BASE_PACKAGES=python3,python3-venv
# The venv gives the image `python` and `pip` on PATH, as python:3.11-slim has,
# and a pip that installs without Debian's externally-managed guard.
readonly BASE_PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

log() { printf 'compose_stack: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

docker_cmd() { docker -H "unix://$SOCKET" "$@"; }

# timed WHAT CMD...: runs CMD and logs how long it took, for the cold/warm figures.
timed() {
  local what=$1 started=$SECONDS
  shift
  "$@"
  log "$what: $((SECONDS - started))s"
}

# Serialises two prepares, or a prepare and an engine-down, on one machine.
take_lock() {
  mkdir -p "$STACK_DIR"
  exec 9>"$STACK_DIR/.lock"
  flock 9
}

# --- packages and tools ------------------------------------------------------------

ensure_packages() {
  local missing=()
  command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
  command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
  ((${#missing[@]} == 0)) && return 0
  ((EUID == 0)) || die "needs ${missing[*]}: apt-get install ${missing[*]} (as root)"
  log "installing ${missing[*]} from Debian's packages"
  apt-get update -q >&2
  # --no-install-recommends: docker.io recommends apparmor, criu, git... none needed here.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
}

# go_binary DEST MODULE VERSION [PACKAGE [LDFLAGS]]: builds PACKAGE of the module
# in the module's own directory, as its main module, so its go.mod (exclude
# directives included, which `go install MODULE@VERSION` refuses) and go.sum apply.
go_binary() {
  local dest=$1 module=$2 version=$3 package=${4:-.} ldflags=${5:-}
  [[ -x $dest ]] && return 0
  command -v go >/dev/null 2>&1 || die "'go' is not installed; it is needed to build $module"
  local gomod=$CACHE/go/mod dir
  mkdir -p "$(dirname "$dest")"
  log "building $module@$version with Go (first run only)..."
  dir=$(GOMODCACHE=$gomod GOFLAGS='' go mod download -json "$module@$version" |
    sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  [[ -d $dir ]] || die "go mod download $module@$version gave no source directory"
  # -mod=readonly: the module's go.sum is the lock file. The module cache is
  # read-only, so the binary goes straight to its cache path.
  (cd "$dir" && GOCACHE=$CACHE/go/build GOMODCACHE=$gomod CGO_ENABLED=0 \
    GOFLAGS='-buildvcs=false -mod=readonly' \
    go build -trimpath -ldflags "-s -w $ldflags" -o "$dest.tmp" "$package") >&2 ||
    die "building $module@$version failed (see above)"
  mv "$dest.tmp" "$dest"
}

ensure_compose() {
  # Built in its module: its go.mod has exclude directives, which `go install` refuses.
  go_binary "$COMPOSE_BIN" github.com/docker/compose/v2 "$COMPOSE_VERSION" ./cmd \
    "-X github.com/docker/compose/v2/internal.Version=$COMPOSE_VERSION"
}

ensure_mc() {
  go_binary "$MC_BIN" github.com/minio/mc "$MC_VERSION"
}

# --- the engine --------------------------------------------------------------------

engine_answers() { docker_cmd version >/dev/null 2>&1; }

# Prints the engine's pid if it runs and is ours (its command line names our data root).
engine_pid() {
  local pid
  [[ -f $ENGINE_PIDFILE ]] || return 1
  pid=$(<"$ENGINE_PIDFILE")
  [[ $pid =~ ^[0-9]+$ && -r /proc/$pid/cmdline ]] || return 1
  local cmdline  # read whole: `tr | grep -q` under pipefail can fail on SIGPIPE
  cmdline=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
  [[ $cmdline == *"--data-root $ENGINE_DIR/data"* ]] || return 1
  echo "$pid"
}

engine_up() {
  if engine_pid >/dev/null && engine_answers; then
    return 0
  fi
  ((EUID == 0)) || die "dockerd runs as root; run this as root"
  mkdir -p "$ENGINE_DIR/data" "$ENGINE_DIR/exec"
  log "starting dockerd (socket $SOCKET, log $ENGINE_DIR/dockerd.log)"
  # Its own session, so a Ctrl-C in the caller does not take it down half-way;
  # 9>&-: it must not inherit the lock. --ip-forward/--ip-masq=false: it touches
  # no sysctl and no NAT either.
  setsid nohup dockerd \
    --data-root "$ENGINE_DIR/data" --exec-root "$ENGINE_DIR/exec" \
    --pidfile "$ENGINE_PIDFILE" -H "unix://$SOCKET" \
    --bridge=none --iptables=false --ip-forward=false --ip-masq=false \
    --storage-driver=overlay2 \
    </dev/null >>"$ENGINE_DIR/dockerd.log" 2>&1 9>&- &
  local deadline=$((SECONDS + ENGINE_TIMEOUT))
  until engine_answers; do
    if ((SECONDS >= deadline)); then
      tail -n 30 "$ENGINE_DIR/dockerd.log" >&2
      die "dockerd did not answer on $SOCKET within ${ENGINE_TIMEOUT}s"
    fi
    sleep 0.5
  done
}

cmd_engine_down() {
  local pid waited=0
  take_lock
  if ! pid=$(engine_pid); then
    log "engine: not running"
    return 0
  fi
  if [[ -n $(docker_cmd ps -q) ]]; then
    docker_cmd ps >&2
    die "containers are still running; '$0 compose down -v' first"
  fi
  kill -TERM "$pid"
  while [[ -e /proc/$pid ]] && ((waited < 60)); do
    sleep 0.5
    waited=$((waited + 1))
  done
  if [[ -e /proc/$pid ]]; then
    log "engine: still running after 30s, sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  # dockerd leaves its namespace mount (exec-root/netns/default) behind on exit;
  # nothing of the engine should outlive it.
  local mountpoint
  awk -v root="$ENGINE_DIR/" 'index($5, root) == 1 { print $5 }' /proc/self/mountinfo |
    sort -r | while IFS= read -r mountpoint; do umount "$mountpoint" || true; done
  log "engine: stopped"
}

# --- images --------------------------------------------------------------------------

base_image() {
  local recipe have rootfs=$STACK_DIR/rootfs
  recipe=$(printf '%s\n' bookworm minbase "$BASE_PACKAGES" "$MIRROR" "$BASE_PATH" | sha256sum | cut -c1-16)
  have=$(docker_cmd image inspect -f '{{ index .Config.Labels "checknrun.recipe" }}' \
    "$BASE_IMAGE" 2>/dev/null || true)
  [[ $have == "$recipe" ]] && return 0
  log "base image: debootstrap bookworm from $MIRROR (first run only)..."
  rm -rf "$rootfs"
  debootstrap --variant=minbase --include="$BASE_PACKAGES" bookworm "$rootfs" "$MIRROR" \
    >"$STACK_DIR/debootstrap.log" 2>&1 ||
    { tail -n 30 "$STACK_DIR/debootstrap.log" >&2; die "debootstrap failed"; }
  chroot "$rootfs" python3 -m venv /opt/python
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | docker_cmd import \
    --change "ENV PATH=$BASE_PATH" \
    --change "LABEL checknrun.recipe=$recipe" \
    --change 'CMD ["python3"]' - "$BASE_IMAGE" >/dev/null
  rm -rf "$rootfs"
}

# The Kafka jars and the MinIO binary, from scripts/services.sh's own cache
# (it fetches or builds them on first use).
service_artifacts() {
  local line
  while IFS= read -r line; do
    case $line in
      KAFKA_LIBS=*) KAFKA_LIBS=${line#KAFKA_LIBS=} ;;
      MINIO_BIN=*) MINIO_BIN=${line#MINIO_BIN=} ;;
    esac
  done < <(bash "$SCRIPT_DIR/services.sh" fetch)
  [[ -d ${KAFKA_LIBS:-} && -x ${MINIO_BIN:-} ]] || die "scripts/services.sh fetch gave no artifacts"
}

# Build contexts for compose.ci.yaml's kafka and minio images: hard links where
# the cache is on one file system, so staging costs nothing and mtimes (which
# BuildKit's context cache compares) stay as they were.
stage_contexts() {
  local kafka=$STACK_DIR/context/kafka minio=$STACK_DIR/context/minio
  rm -rf "$STACK_DIR/context"
  mkdir -p "$kafka" "$minio"
  cp -al "$KAFKA_LIBS" "$kafka/libs" 2>/dev/null || cp -a "$KAFKA_LIBS" "$kafka/libs"
  cp -p "$SCRIPT_DIR/ci_images/kafka.Dockerfile" "$kafka/Dockerfile"
  cp -p "$SCRIPT_DIR/ci_images/kafka-storage.sh" "$SCRIPT_DIR/ci_images/kafka-server-start.sh" \
    "$SCRIPT_DIR/ci_images/kafka-broker-api-versions.sh" "$SCRIPT_DIR/kafka/log4j2.properties" "$kafka/"
  cp -p "$SCRIPT_DIR/ci_images/minio.Dockerfile" "$minio/Dockerfile"
  cp -pl "$MINIO_BIN" "$minio/minio" 2>/dev/null || cp -p "$MINIO_BIN" "$minio/minio"
  cp -pl "$MC_BIN" "$minio/mc" 2>/dev/null || cp -p "$MC_BIN" "$minio/mc"
}

build_images() {
  compose --progress plain build >"$STACK_DIR/build.log" 2>&1 ||
    { tail -n 40 "$STACK_DIR/build.log" >&2; die "compose build failed (log: $STACK_DIR/build.log)"; }
  # A rebuilt image leaves its predecessor untagged, and the build cache keeps its
  # steps: run after run they would fill the disk. The last build's steps (about
  # 6 GB, most of it torch and CUDA) are the newest used, so they stay.
  docker_cmd image prune --force >/dev/null
  docker_cmd builder prune --force --keep-storage "$BUILD_CACHE_KEEP" >>"$STACK_DIR/build.log" 2>&1
}

# --- the env file ----------------------------------------------------------------------

port_in_use() { (exec 2>/dev/null 3<>"/dev/tcp/127.0.0.1/$1"); }

# Below scripts/services.sh's range (20000-31999) and Linux's ephemeral range, so
# the stack never takes a port the shared Kafka and MinIO may pick.
pick_port() {
  local taken=" $* " port _
  for _ in $(seq 1 500); do
    port=$((18000 + RANDOM % 2000))
    if [[ $taken != *" $port "* ]] && ! port_in_use "$port"; then
      echo "$port"
      return 0
    fi
  done
  die "found no free port on 127.0.0.1 in 18000-19999"
}

# The CA bundle the machine's pip trusts (PIP_CERT, pip's config, then the
# variables requests reads); an empty file where there is none, which the
# Dockerfile takes as "pip's own certificates".
pip_cert() {
  local cert
  for cert in "${PIP_CERT:-}" "$(python3 -m pip config get global.cert 2>/dev/null)" \
    "${REQUESTS_CA_BUNDLE:-}" "${SSL_CERT_FILE:-}"; do
    if [[ -n $cert && -s $cert ]]; then
      echo "$cert"
      return 0
    fi
  done
  : >"$STACK_DIR/no-cert"
  echo "$STACK_DIR/no-cert"
}

torch_index() {
  local index=${PIP_INDEX_URL:-}
  [[ -n $index ]] || index=$(python3 -m pip config get global.index-url 2>/dev/null || true)
  echo "${index:-https://pypi.org/simple}"
}

# Fresh ports and secrets on every prepare: the stack is down then, and a port
# some other program took since the last run is simply not picked again.
write_env_file() {
  local -A port
  local name
  for name in KAFKA KAFKA_CONTROLLER MINIO MINIO_CONSOLE SERVER_1 SERVER_2; do
    port[$name]=$(pick_port "${port[@]}")
  done
  cat >"$ENV_FILE.tmp" <<EOF
# Written by scripts/compose_stack.sh prepare; read by its compose command.
export DOCKER_HOST=unix://$SOCKET
export CHECKNRUN_COMPOSE=$COMPOSE_BIN
export CHECKNRUN_CI_KAFKA_PORT=${port[KAFKA]}
export CHECKNRUN_CI_KAFKA_CONTROLLER_PORT=${port[KAFKA_CONTROLLER]}
export CHECKNRUN_CI_MINIO_PORT=${port[MINIO]}
export CHECKNRUN_CI_MINIO_CONSOLE_PORT=${port[MINIO_CONSOLE]}
export CHECKNRUN_CI_SERVER_1_PORT=${port[SERVER_1]}
export CHECKNRUN_CI_SERVER_2_PORT=${port[SERVER_2]}
export CHECKNRUN_CI_KAFKA_CONTEXT=$STACK_DIR/context/kafka
export CHECKNRUN_CI_MINIO_CONTEXT=$STACK_DIR/context/minio
export CHECKNRUN_CI_PIP_CERT=$(pip_cert)
export CHECKNRUN_CI_TORCH_INDEX=$(torch_index)
export CHECKNRUN_S3_TRAINER_ACCESS_KEY=checknrun-trainer
export CHECKNRUN_S3_READER_ACCESS_KEY=checknrun-reader
$(env -i PATH="$PATH" bash "$SCRIPT_DIR/compose_secrets.sh" | sed 's/^/export /')
EOF
  chmod 600 "$ENV_FILE.tmp"
  mv "$ENV_FILE.tmp" "$ENV_FILE"
}

# --- commands --------------------------------------------------------------------------

compose() {
  [[ -f $ENV_FILE ]] || die "no env file yet; run '$0 prepare' first"
  # shellcheck source=/dev/null
  source "$ENV_FILE"
  "$COMPOSE_BIN" --project-name "$PROJECT" --project-directory "$REPO_ROOT" \
    -f "$REPO_ROOT/compose.yaml" -f "$REPO_ROOT/compose.ci.yaml" "$@"
}

cmd_prepare() {
  local started=$SECONDS
  take_lock
  timed "packages" ensure_packages
  timed "engine" engine_up
  timed "compose $COMPOSE_VERSION" ensure_compose
  timed "kafka jars and minio (scripts/services.sh fetch)" service_artifacts
  timed "mc" ensure_mc
  timed "base image" base_image
  stage_contexts
  write_env_file
  timed "images (compose build)" build_images
  log "prepared in $((SECONDS - started))s; env file: $ENV_FILE"
  cat "$ENV_FILE"
}

main() {
  local cmd=${1:-}
  (($# > 0)) && shift
  case $cmd in
    prepare | env | engine-status | engine-down)
      (($# == 0)) || die "'$cmd' takes no arguments"
      case $cmd in
        prepare) cmd_prepare ;;
        env) cat "$ENV_FILE" ;;
        engine-status) engine_pid >/dev/null && engine_answers ;;
        engine-down) cmd_engine_down ;;
      esac
      ;;
    compose) compose "$@" ;;
    *)
      sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//' >&2
      exit 2
      ;;
  esac
}

main "$@"
