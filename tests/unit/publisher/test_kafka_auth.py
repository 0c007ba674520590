"""Kafka login settings from the environment: what each client is given, and what is refused."""

from __future__ import annotations

import pytest

from publisher.bus import KafkaAuth, KafkaAuthError, confluent_config, kafka_python_config

SCRAM_USER = {"CHECKNRUN_KAFKA_USERNAME": "trainer", "CHECKNRUN_KAFKA_PASSWORD": "s3cret"}


def test_nothing_set_is_plaintext_and_adds_nothing() -> None:
    auth = KafkaAuth.from_env({})
    assert auth.protocol == "PLAINTEXT"
    assert auth.confluent() == {} and auth.kafka_python() == {}


def test_a_user_alone_implies_sasl_plaintext_with_scram_sha_512() -> None:
    auth = KafkaAuth.from_env(SCRAM_USER)
    assert auth.confluent() == {
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "trainer",
        "sasl.password": "s3cret",
    }
    assert auth.kafka_python() == {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "trainer",
        "sasl_plain_password": "s3cret",
    }
    assert "s3cret" not in repr(auth)


def test_mechanism_and_protocol_are_read_case_insensitively() -> None:
    env = {
        **SCRAM_USER,
        "CHECKNRUN_KAFKA_SECURITY_PROTOCOL": "sasl_plaintext",
        "CHECKNRUN_KAFKA_SASL_MECHANISM": "scram-sha-256",
    }
    assert KafkaAuth.from_env(env).confluent()["sasl.mechanism"] == "SCRAM-SHA-256"


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"CHECKNRUN_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", **SCRAM_USER}, "TLS is not supported"),
        ({"CHECKNRUN_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT"}, "CHECKNRUN_KAFKA_USERNAME"),
        ({"CHECKNRUN_KAFKA_USERNAME": "trainer"}, "CHECKNRUN_KAFKA_PASSWORD"),
        ({"CHECKNRUN_KAFKA_PASSWORD": "s3cret"}, "PLAINTEXT sends no credentials"),
        ({**SCRAM_USER, "CHECKNRUN_KAFKA_SASL_MECHANISM": "GSSAPI"}, "SCRAM-SHA-512"),
    ],
)
def test_settings_that_cannot_work_are_refused_naming_the_setting(
    env: dict[str, str], names: str
) -> None:
    with pytest.raises(KafkaAuthError, match=names):
        KafkaAuth.from_env(env)


def test_client_configs_take_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SCRAM_USER.items():
        monkeypatch.setenv(name, value)
    assert confluent_config({"bootstrap.servers": "b:9092"})["sasl.username"] == "trainer"
    config = kafka_python_config({"bootstrap_servers": ["b:9092"]})
    assert config["bootstrap_servers"] == ["b:9092"]
    assert config["sasl_plain_password"] == "s3cret"
