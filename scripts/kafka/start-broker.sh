#!/bin/sh
# Starts one Kafka node (KRaft) in the foreground from KAFKA_* variables: compose.yaml runs it
# in the apache/kafka image, compose.ci.yaml in CI's stand-in (scripts/ci_images/kafka.Dockerfile),
# both through the image's /opt/kafka/bin scripts.
#
# - Each KAFKA_FOO_BAR=v becomes foo.bar=v in server.properties ('__' stands for '_' and '___'
#   for '-'), as the image's own start script does; the JVM's KAFKA_*_OPTS are left to the scripts.
# - The storage is formatted once with CLUSTER_ID; with CHECKNRUN_KAFKA_ADMIN_PASSWORD set, the
#   format also adds the SCRAM-SHA-512 credential of CHECKNRUN_KAFKA_ADMIN_USER (default admin):
#   SCRAM users live in the cluster's metadata, so the first one (the brokers' own, the one that
#   creates the others) must be there before the broker starts, which the image's start script
#   cannot do. It is read at the first format only: a later password needs kafka-configs.sh.
# - The admin's client settings are written for the healthcheck
#   (kafka-broker-api-versions.sh --command-config "$CHECKNRUN_KAFKA_CONFIG_DIR/admin.properties").
set -eu
dir=${CHECKNRUN_KAFKA_CONFIG_DIR:-/tmp/checknrun-kafka}
conf=$dir/server.properties
umask 077
mkdir -p "$dir"

: "${CLUSTER_ID:?CLUSTER_ID must be set (16 random bytes, URL-safe base64)}"
env | sort | while IFS='=' read -r name value; do
  case $name in
    # JVM options for the scripts, not broker properties (as in the official image).
    KAFKA_HEAP_OPTS | KAFKA_OPTS | KAFKA_JVM_PERFORMANCE_OPTS | KAFKA_LOG4J_OPTS | KAFKA_JMX_OPTS | \
      KAFKA_GC_LOG_OPTS | KAFKA_DEBUG) ;;
    KAFKA_*)
      key=$(printf '%s' "${name#KAFKA_}" | tr '[:upper:]' '[:lower:]' | sed 's/___/-/g; s/__/@/g; s/_/./g; s/@/_/g')
      printf '%s=%s\n' "$key" "$value"
      ;;
  esac
done >"$conf"

# --ignore-formatted: a restart on the same volume keeps its data (and its users).
set -- format --config "$conf" --cluster-id "$CLUSTER_ID" --ignore-formatted
if [ -n "${CHECKNRUN_KAFKA_ADMIN_PASSWORD:-}" ]; then
  admin=${CHECKNRUN_KAFKA_ADMIN_USER:-admin}
  set -- "$@" --add-scram "SCRAM-SHA-512=[name=$admin,password=$CHECKNRUN_KAFKA_ADMIN_PASSWORD]"
  cat >"$dir/admin.properties" <<PROPERTIES
security.protocol=SASL_PLAINTEXT
sasl.mechanism=SCRAM-SHA-512
sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="$admin" password="$CHECKNRUN_KAFKA_ADMIN_PASSWORD";
PROPERTIES
fi
/opt/kafka/bin/kafka-storage.sh "$@"
exec /opt/kafka/bin/kafka-server-start.sh "$conf"
