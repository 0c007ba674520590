#!/usr/bin/env bash
# Prints fresh random values for the secrets compose.yaml requires, as a .env file:
#
#   bash scripts/compose_secrets.sh > .env      then: docker compose up --build
#
# compose.yaml gives no secret a default and refuses to start while one is unset.
# A variable already set in the environment is printed as it is, so a rerun keeps
# secrets a volume already holds (Kafka's admin password, MinIO's root password)
# when they are exported. scripts/compose_stack.sh writes CI's the same way.
set -euo pipefail

SECRETS=(
  CHECKNRUN_MINIO_ROOT_PASSWORD
  CHECKNRUN_S3_TRAINER_SECRET_KEY
  CHECKNRUN_S3_READER_SECRET_KEY
  CHECKNRUN_KAFKA_ADMIN_PASSWORD
  CHECKNRUN_KAFKA_TRAINER_PASSWORD
  CHECKNRUN_KAFKA_SERVER_PASSWORD
  CHECKNRUN_KAFKA_PRODUCER_PASSWORD
)

for name in "${SECRETS[@]}"; do
  value=${!name:-}
  # 20 random bytes as hex: letters and digits only, as the Kafka and MinIO settings need.
  [[ -n $value ]] || value=$(head -c 20 /dev/urandom | od -An -tx1 | tr -d ' \n')
  printf '%s=%s\n' "$name" "$value"
done
