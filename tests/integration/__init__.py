"""Tests against the real Kafka broker and MinIO server (see conftest.py)."""
