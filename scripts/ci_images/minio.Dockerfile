# CI's stand-in for the minio/minio and minio/mc images compose.yaml names: the
# MinIO server scripts/services.sh builds with the Go module proxy and the mc
# client at the version that MinIO's own go.mod requires, both on one image as
# minio/minio ships them. Built by scripts/compose_stack.sh, whose build context
# holds the two binaries.
FROM checknrun-ci/base:bookworm
COPY minio mc /usr/bin/
ENTRYPOINT ["minio"]
