"""Tests that talk to the shared Kafka broker and MinIO server.

tests/services.py says where the services come from; tests/conftest.py marks every test here
`integration` and holds the `services`, `unique_name` and `minio_client` fixtures (root-level, so
the contract suites' S3 and Kafka parameters use them too).
"""

from __future__ import annotations

from tests.services import Services

# Tests here import Services from this module.
__all__ = ["Services"]
