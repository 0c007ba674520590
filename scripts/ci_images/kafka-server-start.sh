#!/bin/sh
# The apache/kafka image's broker start script, which scripts/kafka/start-broker.sh runs: the
# broker in the foreground, its heap from KAFKA_HEAP_OPTS (the same default).
# shellcheck disable=SC2086  # the option variables hold several flags on purpose
exec java ${KAFKA_HEAP_OPTS:--Xmx1G -Xms1G} ${KAFKA_OPTS:-} -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
  -Djava.awt.headless=true -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties \
  -cp '/opt/kafka/libs/*' kafka.Kafka "$@"
