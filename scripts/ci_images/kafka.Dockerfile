# CI's stand-in for the apache/kafka image compose.yaml names: the same broker
# (the jars scripts/services.sh fetches from Maven Central, scripts/kafka/pom.xml),
# a JRE from Debian, and the image's bin/ scripts that compose.yaml's start script
# (scripts/kafka/start-broker.sh) and healthcheck run. Built by
# scripts/compose_stack.sh, whose build context holds libs/ and the scripts below.
FROM checknrun-ci/base:bookworm

RUN apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
    && rm -rf /var/lib/apt/lists/*

# The official image's user and paths: a volume mounted on the data dir starts
# out owned by the broker's user.
RUN useradd --system --uid 1000 --home-dir /opt/kafka --shell /usr/sbin/nologin appuser \
    && mkdir -p /var/lib/kafka/data /etc/kafka \
    && chown appuser /var/lib/kafka/data /etc/kafka
COPY libs /opt/kafka/libs
COPY log4j2.properties /opt/kafka/config/log4j2.properties
COPY kafka-storage.sh kafka-server-start.sh kafka-broker-api-versions.sh /opt/kafka/bin/

USER appuser
ENTRYPOINT ["/opt/kafka/bin/kafka-server-start.sh"]
