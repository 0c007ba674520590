#!/usr/bin/env bash
# Runs the two services the integration tests need, Kafka (KRaft, one combined
# broker+controller node) and MinIO, as plain local processes: no Docker.
#
#   scripts/services.sh up     [kafka|minio]...   start (idempotent), print the env file
#   scripts/services.sh down   [kafka|minio]...   stop: SIGTERM, wait, then SIGKILL
#   scripts/services.sh status [kafka|minio]...   exit 0 only if all are running
#   scripts/services.sh logs   [kafka|minio]...   tail the logs (LINES=50)
#   scripts/services.sh env                       print the env file
#   scripts/services.sh fetch                     fetch/build only; print KAFKA_LIBS= and MINIO_BIN=
#   scripts/services.sh purge                     down, then delete ports, secrets and data
#
# Typical use:  eval "$(scripts/services.sh up)"
#
# Everything is fetched through package registries only: the Kafka jars come from
# Maven Central (scripts/kafka/pom.xml) and MinIO is built from source with the Go
# module proxy. Both are cached under $CHECKNRUN_CACHE, so only the first run is
# slow (the MinIO build takes 4-10 minutes on 2 cores).
#
# Ports, secrets and data dirs are chosen once and kept in the run dir, so
# `down kafka; up kafka` brings the broker back on the same address with the same
# topics and clients reconnect; fault tests rely on that.
#
# Knobs (environment): CHECKNRUN_CACHE (default ~/.cache/checknrun),
# CHECKNRUN_SERVICES_DIR (run state, default $CHECKNRUN_CACHE/services),
# CHECKNRUN_SERVICES_TIMEOUT (readiness wait per service, default 180 s),
# CHECKNRUN_KAFKA_HEAP, CHECKNRUN_MINIO_VERSION.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
readonly SCRIPT_DIR
readonly CACHE=${CHECKNRUN_CACHE:-$HOME/.cache/checknrun}
readonly DIR=${CHECKNRUN_SERVICES_DIR:-$CACHE/services}
readonly STATE_FILE=$DIR/state
readonly ENV_FILE=$DIR/env
readonly LOG_DIR=$DIR/logs
readonly READY_TIMEOUT=${CHECKNRUN_SERVICES_TIMEOUT:-180}
readonly STOP_TIMEOUT=30

# master as of 2026-02-12: MinIO publishes no semver tags, so the proxy only
# knows pseudo-versions; pinning one keeps the cached binary valid.
readonly MINIO_VERSION=${CHECKNRUN_MINIO_VERSION:-v0.0.0-20260212201848-7aac2a2c5b7c}
readonly MINIO_USER=checknrun-admin
readonly S3_REGION=us-east-1
readonly KAFKA_HEAP=${CHECKNRUN_KAFKA_HEAP:--Xmx512m -Xms128m}
readonly ALL_SERVICES=(kafka minio)

JAVA=${JAVA_HOME:+$JAVA_HOME/bin/}java
KAFKA_LIBS=
KAFKA_JVM=()
MINIO_BIN=
HEARTBEAT_PID=

log() { printf 'services: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# need PURPOSE TOOL...: fail early and say why, rather than half-way through.
need() {
  local purpose=$1 tool
  shift
  for tool in "$@"; do
    command -v "$tool" >/dev/null 2>&1 || die "'$tool' is not installed; it is needed to $purpose"
  done
}

on_exit() {
  if [[ -n $HEARTBEAT_PID ]]; then kill "$HEARTBEAT_PID" 2>/dev/null || true; fi
}
trap on_exit EXIT

# --- ports and state -----------------------------------------------------------

port_in_use() { (exec 2>/dev/null 3<>"/dev/tcp/127.0.0.1/$1"); }

# Picks below Linux's ephemeral range (32768+) so that an outgoing connection
# cannot be holding the port when a service is restarted on it later.
pick_port() {
  local taken=" $* " port _
  for _ in $(seq 1 500); do
    port=$((20000 + RANDOM % 12000))
    if [[ $taken != *" $port "* ]] && ! port_in_use "$port"; then
      echo "$port"
      return 0
    fi
  done
  die "found no free port on 127.0.0.1 in 20000-31999"
}

random_hex() { head -c "$1" /dev/urandom | od -An -tx1 | tr -d ' \n'; }

# Written once; every later start reads it back, which is what keeps restarts on
# the same ports and credentials.
ensure_state() {
  mkdir -p "$DIR" "$LOG_DIR"
  if [[ ! -f $STATE_FILE ]]; then
    local kafka_port controller_port minio_port console_port cluster_id
    kafka_port=$(pick_port)
    controller_port=$(pick_port "$kafka_port")
    minio_port=$(pick_port "$kafka_port" "$controller_port")
    console_port=$(pick_port "$kafka_port" "$controller_port" "$minio_port")
    # A Kafka cluster id is 16 random bytes in URL-safe base64 without padding.
    cluster_id=$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n')
    cat >"$STATE_FILE.tmp" <<EOF
KAFKA_PORT=$kafka_port
KAFKA_CONTROLLER_PORT=$controller_port
KAFKA_CLUSTER_ID=$cluster_id
MINIO_PORT=$minio_port
MINIO_CONSOLE_PORT=$console_port
MINIO_PASSWORD=$(random_hex 20)
EOF
    mv "$STATE_FILE.tmp" "$STATE_FILE"
  fi
  # shellcheck source=/dev/null
  source "$STATE_FILE"
  write_env_file
}

# shellcheck disable=SC2153  # the ports come from the sourced state file
write_env_file() {
  cat >"$ENV_FILE.tmp" <<EOF
# Written by scripts/services.sh; source it or eval "\$(scripts/services.sh env)".
export CHECKNRUN_KAFKA_BOOTSTRAP=127.0.0.1:$KAFKA_PORT
export CHECKNRUN_S3_ENDPOINT=127.0.0.1:$MINIO_PORT
export CHECKNRUN_S3_ACCESS_KEY=$MINIO_USER
export CHECKNRUN_S3_SECRET_KEY=$MINIO_PASSWORD
export CHECKNRUN_S3_SECURE=0
export CHECKNRUN_S3_REGION=$S3_REGION
EOF
  mv "$ENV_FILE.tmp" "$ENV_FILE"
}

# --- processes -------------------------------------------------------------------

# Succeeds while process $1 exists and is not a zombie.
pid_alive() {
  local stat
  { read -r stat <"/proc/$1/stat"; } 2>/dev/null || return 1
  stat=${stat##*) }
  [[ ${stat%% *} != Z ]]
}

# Prints the pid of the service if its recorded process is alive and still ours.
running_pid() {
  local pid_file=$DIR/$1.pid pid
  [[ -f $pid_file ]] || return 1
  pid=$(<"$pid_file")
  [[ $pid =~ ^[0-9]+$ ]] && pid_alive "$pid" || return 1
  # After a reboot the pid may belong to some other program; ours name the run dir.
  # Read whole, then matched: `tr | grep -q` under pipefail fails when grep exits before tr
  # has written (SIGPIPE), and a live service was once reported dead that way.
  local cmdline
  cmdline=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
  [[ $cmdline == *"$DIR"* ]] || return 1
  echo "$pid"
}

# Starts "$@" detached from this shell: its own session, so a Ctrl-C in the test
# run that called us does not take the broker down, and no inherited stdout, so
# a caller capturing our output is not kept waiting for the service to exit.
spawn() {
  local name=$1
  shift
  printf '\n===== %s starting %s =====\n' "$(date -u +%FT%TZ)" "$name" >>"$LOG_DIR/$name.log"
  # 9>&-: the service must not inherit the lock (take_lock), or it would hold it
  # for as long as it runs.
  setsid nohup "$@" </dev/null >>"$LOG_DIR/$name.log" 2>&1 9>&- &
  local pid=$! _
  echo "$pid" >"$DIR/$name.pid"
  # Until the child execs, its command line is still this script's and
  # running_pid would call it dead: wait for the exec (or the child's death). On a
  # loaded machine it took more than the 5 s once allowed, and a healthy MinIO was
  # reported as "exited during startup".
  local deadline=$((SECONDS + READY_TIMEOUT))
  while ((SECONDS < deadline)); do
    running_pid "$name" >/dev/null && return 0
    [[ -e /proc/$pid ]] || return 0
    sleep 0.1
  done
}

stop_service() {
  local name=$1 pid waited=0
  if ! pid=$(running_pid "$name"); then
    rm -f "$DIR/$name.pid"
    log "$name: not running"
    return 0
  fi
  log "$name: stopping (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  # Waited on by pid, not by running_pid: an exiting process has already let go of
  # its memory, so its command line reads empty while it may still hold its port.
  while pid_alive "$pid" && ((waited < STOP_TIMEOUT * 2)); do
    sleep 0.5
    waited=$((waited + 1))
  done
  if pid_alive "$pid"; then
    log "$name: still running after ${STOP_TIMEOUT}s, sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    sleep 0.5
  fi
  rm -f "$DIR/$name.pid"
  log "$name: stopped"
}

fail_with_log() {
  local name=$1
  shift
  log "error: $*"
  log "last lines of $LOG_DIR/$name.log:"
  tail -n 40 "$LOG_DIR/$name.log" >&2 || true
  exit 1
}

# Polls "$2..." until it succeeds, failing early if the service process died.
# Death is judged by pid alone: the service was just spawned (or found running),
# and while it execs (setsid, nohup, the server) its command line reads empty for
# a moment, which running_pid takes for a dead process; CI once failed on that
# with a healthy MinIO ("exited during startup", its banner printed after).
wait_until() {
  local name=$1 deadline=$((SECONDS + READY_TIMEOUT)) pid
  shift
  pid=$(<"$DIR/$name.pid")
  until "$@"; do
    pid_alive "$pid" || fail_with_log "$name" "$name exited during startup"
    ((SECONDS < deadline)) || fail_with_log "$name" "$name not ready after ${READY_TIMEOUT}s"
    sleep 1
  done
}

start_heartbeat() {
  local what=$1 started=$SECONDS
  (while sleep 60; do log "$what: still working ($((SECONDS - started))s so far)"; done) &
  HEARTBEAT_PID=$!
}

stop_heartbeat() {
  kill "$HEARTBEAT_PID" 2>/dev/null || true
  wait "$HEARTBEAT_PID" 2>/dev/null || true
  HEARTBEAT_PID=
}

# --- kafka -----------------------------------------------------------------------

ensure_kafka_libs() {
  local pom=$SCRIPT_DIR/kafka/pom.xml dest
  # Keyed by the pom's hash so a version bump fetches a fresh, unmixed classpath.
  dest=$CACHE/kafka/$(sha256sum "$pom" | cut -c1-16)
  KAFKA_LIBS=$dest/libs
  [[ -f $dest/complete ]] && return 0
  need "fetch Kafka from Maven Central" mvn
  log "kafka: fetching the Kafka jars from Maven Central (first run only, ~1 min)..."
  rm -rf "$dest"
  mkdir -p "$dest"
  # -B: no stdin and no progress bars in CI. The local repo lives in the cache so
  # the whole setup can be wiped with one rm.
  if ! mvn -B -Dstyle.color=never -f "$pom" -Dmaven.repo.local="$CACHE/m2" \
    dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$KAFKA_LIBS" \
    >"$LOG_DIR/kafka-fetch.log" 2>&1; then
    tail -n 40 "$LOG_DIR/kafka-fetch.log" >&2
    die "mvn could not fetch the Kafka jars (full output: $LOG_DIR/kafka-fetch.log)"
  fi
  rm -rf "$SCRIPT_DIR/kafka/target"
  touch "$dest/complete"
}

write_kafka_config() {
  local conf=$DIR/kafka
  mkdir -p "$conf/data"
  # Copied so a running broker does not depend on the work tree it was started from.
  cp "$SCRIPT_DIR/kafka/log4j2.properties" "$conf/log4j2.properties"
  cat >"$conf/server.properties" <<EOF
# Written by scripts/services.sh on every start; edit the script, not this file.
process.roles=broker,controller
node.id=1
# Static voters: the controller address is pinned here, not in the formatted log,
# so a restart on the same ports needs nothing else.
controller.quorum.voters=1@127.0.0.1:$KAFKA_CONTROLLER_PORT
listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$KAFKA_CONTROLLER_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$conf/data

# One node: every replication factor must be 1 or internal topics never appear.
num.partitions=1
default.replication.factor=1
min.insync.replicas=1
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
auto.create.topics.enable=true
# Tests start one consumer at a time; the default 3 s delay is pure waiting.
group.initial.rebalance.delay.ms=0

# Sized for a 2-core machine shared with the tests.
num.network.threads=2
num.io.threads=2
background.threads=2
EOF
  cat >"$conf/probe.properties" <<EOF
request.timeout.ms=5000
default.api.timeout.ms=10000
EOF
}

# The broker's JVM command line, minus the main class; set once the jars exist.
kafka_jvm() {
  # shellcheck disable=SC2206  # KAFKA_HEAP holds several flags on purpose.
  KAFKA_JVM=("$JAVA" $KAFKA_HEAP -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -Djava.awt.headless=true
    -Dlog4j2.configurationFile="$DIR/kafka/log4j2.properties" -cp "$KAFKA_LIBS/*")
}

kafka_answers() {
  # TopicCommand speaks the real protocol, so success means a client can use the
  # broker, not just that a socket is open.
  port_in_use "$KAFKA_PORT" || return 1
  timeout 30 "$JAVA" -Xmx128m -Dchecknrun.kafka.loglevel=WARN \
    -Dlog4j2.configurationFile="$DIR/kafka/log4j2.properties" -cp "$KAFKA_LIBS/*" \
    org.apache.kafka.tools.TopicCommand --bootstrap-server "127.0.0.1:$KAFKA_PORT" \
    --command-config "$DIR/kafka/probe.properties" --list >"$LOG_DIR/kafka-probe.log" 2>&1
}

up_kafka() {
  local pid
  need "run Kafka" "$JAVA"
  ensure_kafka_libs
  kafka_jvm
  if pid=$(running_pid kafka); then
    log "kafka: already running (pid $pid) on 127.0.0.1:$KAFKA_PORT"
    wait_until kafka kafka_answers
    return 0
  fi
  local port
  for port in "$KAFKA_PORT" "$KAFKA_CONTROLLER_PORT"; do
    port_in_use "$port" && die "port $port on 127.0.0.1 is held by another process" \
      "(not ours); stop it, or '$0 purge' to pick new ports"
  done
  write_kafka_config
  if [[ ! -f $DIR/kafka/data/meta.properties ]]; then
    log "kafka: formatting storage (cluster $KAFKA_CLUSTER_ID)"
    "${KAFKA_JVM[@]}" kafka.tools.StorageTool format --config "$DIR/kafka/server.properties" \
      --cluster-id "$KAFKA_CLUSTER_ID" >>"$LOG_DIR/kafka.log" 2>&1 ||
      fail_with_log kafka "kafka storage format failed"
  fi
  log "kafka: starting on 127.0.0.1:$KAFKA_PORT (controller 127.0.0.1:$KAFKA_CONTROLLER_PORT)"
  spawn kafka "${KAFKA_JVM[@]}" kafka.Kafka "$DIR/kafka/server.properties"
  local started=$SECONDS
  wait_until kafka kafka_answers
  log "kafka: ready in $((SECONDS - started))s"
}

# --- minio -----------------------------------------------------------------------

ensure_minio_binary() {
  local bindir=$CACHE/minio/$MINIO_VERSION
  MINIO_BIN=$bindir/minio
  [[ -x $MINIO_BIN ]] && return 0
  need "build MinIO from source" go
  log "minio: building $MINIO_VERSION from source (first run only, ~4-10 min on 2 cores)..."
  log "minio: build output goes to $LOG_DIR/minio-build.log"
  local started=$SECONDS
  start_heartbeat "minio build"
  # Build and module caches live in the cache dir so a rerun (or a CI run on the
  # same machine) only relinks; GOFLAGS is reset so a caller's -mod=vendor etc.
  # cannot leak into a build of someone else's module.
  if ! GOBIN=$bindir GOCACHE=$CACHE/go/build GOMODCACHE=$CACHE/go/mod GOFLAGS=-buildvcs=false \
    go install "github.com/minio/minio@$MINIO_VERSION" >>"$LOG_DIR/minio-build.log" 2>&1; then
    stop_heartbeat
    tail -n 40 "$LOG_DIR/minio-build.log" >&2
    die "building MinIO failed (full output: $LOG_DIR/minio-build.log)"
  fi
  stop_heartbeat
  log "minio: built in $((SECONDS - started))s"
}

# GET over bash's /dev/tcp, since neither curl nor python can be assumed. MinIO
# answers 200 on /minio/health/live even before its object layer is up, marking
# that case with "x-minio-server-status: offline", so the header is checked too.
minio_answers() {
  local reply
  reply=$(
    exec 2>/dev/null # bash reports a refused connect on stderr; that is just "not yet"
    exec 3<>"/dev/tcp/127.0.0.1/$MINIO_PORT" || exit 1
    printf 'GET /minio/health/live HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n' >&3
    timeout 5 cat <&3
  ) || return 1
  [[ $reply == HTTP/1.?" 200"* && ${reply,,} != *"x-minio-server-status: offline"* ]]
}

up_minio() {
  local pid
  ensure_minio_binary
  if pid=$(running_pid minio); then
    log "minio: already running (pid $pid) on 127.0.0.1:$MINIO_PORT"
    wait_until minio minio_answers
    return 0
  fi
  local port
  for port in "$MINIO_PORT" "$MINIO_CONSOLE_PORT"; do
    port_in_use "$port" && die "port $port on 127.0.0.1 is held by another process" \
      "(not ours); stop it, or '$0 purge' to pick new ports"
  done
  mkdir -p "$DIR/minio/data"
  log "minio: starting on 127.0.0.1:$MINIO_PORT (console 127.0.0.1:$MINIO_CONSOLE_PORT)"
  MINIO_ROOT_USER=$MINIO_USER MINIO_ROOT_PASSWORD=$MINIO_PASSWORD \
    MINIO_SITE_REGION=$S3_REGION MINIO_UPDATE=off \
    spawn minio "$MINIO_BIN" server "$DIR/minio/data" \
    --address "127.0.0.1:$MINIO_PORT" --console-address "127.0.0.1:$MINIO_CONSOLE_PORT"
  local started=$SECONDS
  wait_until minio minio_answers
  log "minio: ready in $((SECONDS - started))s"
}

# --- commands --------------------------------------------------------------------

# Serialises concurrent callers (two test sessions, a user and a test) so they
# cannot both pick ports or both start a broker.
take_lock() {
  mkdir -p "$DIR"
  exec 9>"$DIR/.lock"
  if command -v flock >/dev/null 2>&1; then flock 9; fi
}

services_from_args() {
  local name
  if (($# == 0)); then
    SERVICES=("${ALL_SERVICES[@]}")
    return 0
  fi
  for name in "$@"; do
    [[ $name == kafka || $name == minio ]] || die "unknown service '$name' (kafka or minio)"
  done
  SERVICES=("$@")
}

cmd_up() {
  local name started=$SECONDS
  services_from_args "$@"
  take_lock
  ensure_state
  for name in "${SERVICES[@]}"; do "up_$name"; done
  log "up in $((SECONDS - started))s; env file: $ENV_FILE"
  cat "$ENV_FILE"
}

cmd_down() {
  local name
  services_from_args "$@"
  [[ -d $DIR ]] || { log "nothing to stop"; return 0; }
  take_lock
  for name in "${SERVICES[@]}"; do stop_service "$name"; done
}

cmd_status() {
  local name pid all_up=0
  services_from_args "$@"
  if [[ ! -f $STATE_FILE ]]; then
    log "not set up yet (no $STATE_FILE)"
    return 1
  fi
  # shellcheck source=/dev/null
  source "$STATE_FILE"
  for name in "${SERVICES[@]}"; do
    local addr health
    if [[ $name == kafka ]]; then addr=127.0.0.1:$KAFKA_PORT; else addr=127.0.0.1:$MINIO_PORT; fi
    if pid=$(running_pid "$name"); then
      local port=${addr##*:}
      if port_in_use "$port"; then health="accepting connections"; else health="not listening yet"; fi
      echo "$name: running, pid $pid, $addr, $health, log $LOG_DIR/$name.log"
    else
      echo "$name: stopped ($addr when up)"
      all_up=1
    fi
  done
  return "$all_up"
}

cmd_logs() {
  local name
  services_from_args "$@"
  for name in "${SERVICES[@]}"; do
    echo "==> $LOG_DIR/$name.log <=="
    tail -n "${LINES:-50}" "$LOG_DIR/$name.log" 2>/dev/null || echo "(no log yet)"
  done
}

cmd_env() {
  [[ -f $ENV_FILE ]] || die "no env file yet; run '$0 up' first"
  cat "$ENV_FILE"
}

# For scripts/compose_stack.sh, which builds its images from the same artifacts.
cmd_fetch() {
  take_lock
  mkdir -p "$LOG_DIR"
  ensure_kafka_libs
  ensure_minio_binary
  printf 'KAFKA_LIBS=%s\nMINIO_BIN=%s\n' "$KAFKA_LIBS" "$MINIO_BIN"
}

cmd_purge() {
  cmd_down kafka minio
  log "deleting $DIR (ports, secrets, data, logs)"
  rm -rf "$DIR"
}

main() {
  local cmd=${1:-}
  (($# > 0)) && shift
  case $cmd in
    up | down | status | logs) "cmd_$cmd" "$@" ;;
    env | purge | fetch)
      (($# == 0)) || die "'$cmd' takes no arguments"
      "cmd_$cmd"
      ;;
    *)
      sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2
      exit 2
      ;;
  esac
}

main "$@"
