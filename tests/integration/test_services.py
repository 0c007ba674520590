"""Smoke tests: the services from conftest.py answer real clients.

When these fail, every other integration test will too; look here first.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.admin import NewTopic
from minio import Minio

if TYPE_CHECKING:
    # Type only: conftest is loaded by pytest, not importable under a stable name.
    from tests.integration.conftest import Services


def test_minio_put_then_get_returns_the_same_bytes(minio_client: Minio, unique_name: str) -> None:
    bucket, key = unique_name, "smoke/object.bin"
    payload = bytes(range(256)) * 16
    minio_client.make_bucket(bucket)
    try:
        minio_client.put_object(bucket, key, io.BytesIO(payload), length=len(payload))
        response = minio_client.get_object(bucket, key)
        try:
            fetched = response.read()
        finally:
            response.close()
            response.release_conn()
        assert fetched == payload
        assert minio_client.stat_object(bucket, key).size == len(payload)
    finally:
        for obj in minio_client.list_objects(bucket, recursive=True):
            minio_client.remove_object(bucket, obj.object_name)
        minio_client.remove_bucket(bucket)


def test_kafka_messages_come_back_in_order_with_their_keys(
    services: Services, unique_name: str
) -> None:
    topic = unique_name
    admin = KafkaAdminClient(bootstrap_servers=services.kafka_bootstrap)
    try:
        admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])

        producer = KafkaProducer(bootstrap_servers=services.kafka_bootstrap, acks="all")
        try:
            sent = [(b"movielens", f"version-{i}".encode()) for i in range(3)]
            for key, value in sent:
                # .get() so a failed send fails the test here, not silently.
                producer.send(topic, key=key, value=value).get(timeout=30)
        finally:
            producer.close(timeout=10)

        consumer = KafkaConsumer(
            topic,
            bootstrap_servers=services.kafka_bootstrap,
            group_id=None,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            consumer_timeout_ms=10_000,
        )
        try:
            received = []
            for message in consumer:
                received.append(message)
                if len(received) == len(sent):
                    break
        finally:
            consumer.close()

        assert [(m.key, m.value) for m in received] == sent
        assert [m.offset for m in received] == [0, 1, 2]
    finally:
        admin.delete_topics([topic])
        admin.close()
