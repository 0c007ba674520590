#!/bin/sh
# The apache/kafka image's storage tool, which scripts/kafka/start-broker.sh runs.
exec java -Xmx128m -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties \
  -cp '/opt/kafka/libs/*' kafka.tools.StorageTool "$@"
