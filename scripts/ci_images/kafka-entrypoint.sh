#!/bin/sh
# Starts one Kafka node the way the apache/kafka image does when KAFKA_* variables
# are set: each KAFKA_FOO_BAR=v becomes foo.bar=v in server.properties ('__' stands
# for '_' and '___' for '-'), the storage is formatted once with CLUSTER_ID, and
# the broker runs in the foreground.
set -eu
conf=/etc/kafka/server.properties
libs='/opt/kafka/libs/*'
log4j=-Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties

: "${CLUSTER_ID:?CLUSTER_ID must be set (16 random bytes, URL-safe base64)}"
env | sort | while IFS='=' read -r name value; do
  case $name in
    # JVM options, not broker properties (as in the official image).
    KAFKA_HEAP_OPTS | KAFKA_OPTS | KAFKA_JVM_PERFORMANCE_OPTS | KAFKA_LOG4J_OPTS | KAFKA_JMX_OPTS) ;;
    KAFKA_*)
      key=$(printf '%s' "${name#KAFKA_}" | tr '[:upper:]' '[:lower:]' | sed 's/___/-/g; s/__/@/g; s/_/./g; s/@/_/g')
      printf '%s=%s\n' "$key" "$value"
      ;;
  esac
done >"$conf"

# --ignore-formatted: a restart on the same volume keeps its data.
java -Xmx128m $log4j -cp "$libs" kafka.tools.StorageTool format --config "$conf" \
  --cluster-id "$CLUSTER_ID" --ignore-formatted

# shellcheck disable=SC2086  # the option variables hold several flags on purpose
exec java ${KAFKA_HEAP_OPTS:--Xmx1G -Xms1G} ${KAFKA_OPTS:-} -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
  -Djava.awt.headless=true $log4j -cp "$libs" kafka.Kafka "$conf"
