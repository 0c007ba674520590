"""How checknrun's Kafka clients log in to a broker: from the environment, every client alike.

    CHECKNRUN_KAFKA_SECURITY_PROTOCOL   PLAINTEXT (the default) or SASL_PLAINTEXT
    CHECKNRUN_KAFKA_SASL_MECHANISM      SCRAM-SHA-512 (the default), SCRAM-SHA-256 or PLAIN
    CHECKNRUN_KAFKA_USERNAME            the SASL user (set alone, it implies SASL_PLAINTEXT)
    CHECKNRUN_KAFKA_PASSWORD            its password

In the environment and not in the URL, as the store's keys are: a kafka:// URL is logged, kept in
manifests and shown by `ls`. Every Kafka client the project makes reads them: the announcer and
the followers (kafka-python), the trainer's event reader, `checknrun replay` and the benches
(confluent-kafka). TLS (SSL, SASL_SSL) is not supported yet: a setting asking for it is refused,
never silently sent in plain text.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from publisher.bus.base import BusError

PROTOCOLS = ("PLAINTEXT", "SASL_PLAINTEXT")
MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN")


class KafkaAuthError(BusError):
    """Kafka login settings that cannot work (a protocol without its user, an unknown one)."""


@dataclass(frozen=True)
class KafkaAuth:
    """One way of logging in to the brokers: none (PLAINTEXT) or a SASL user."""

    protocol: str = "PLAINTEXT"
    mechanism: str = "SCRAM-SHA-512"
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KafkaAuth:
        """The settings of the module docstring; KafkaAuthError names the one that is wrong."""
        env = os.environ if environ is None else environ
        username = env.get("CHECKNRUN_KAFKA_USERNAME") or None
        password = env.get("CHECKNRUN_KAFKA_PASSWORD") or None
        default = "SASL_PLAINTEXT" if username else "PLAINTEXT"
        protocol = (env.get("CHECKNRUN_KAFKA_SECURITY_PROTOCOL") or default).upper()
        mechanism = (env.get("CHECKNRUN_KAFKA_SASL_MECHANISM") or MECHANISMS[0]).upper()
        if protocol not in PROTOCOLS:
            raise KafkaAuthError(
                f"CHECKNRUN_KAFKA_SECURITY_PROTOCOL={protocol}: expected one of "
                f"{', '.join(PROTOCOLS)} (TLS is not supported yet)"
            )
        if protocol == "PLAINTEXT":
            if username or password:
                raise KafkaAuthError(
                    "CHECKNRUN_KAFKA_USERNAME/PASSWORD are set but "
                    "CHECKNRUN_KAFKA_SECURITY_PROTOCOL=PLAINTEXT sends no credentials"
                )
            return cls()
        if mechanism not in MECHANISMS:
            raise KafkaAuthError(
                f"CHECKNRUN_KAFKA_SASL_MECHANISM={mechanism}: expected one of "
                f"{', '.join(MECHANISMS)}"
            )
        if not username or not password:
            raise KafkaAuthError(
                f"{protocol} needs CHECKNRUN_KAFKA_USERNAME and CHECKNRUN_KAFKA_PASSWORD"
            )
        return cls(protocol, mechanism, username, password)

    def confluent(self) -> dict[str, Any]:
        """The settings for a confluent-kafka (librdkafka) client's config."""
        if self.protocol == "PLAINTEXT":
            return {}
        return {
            "security.protocol": self.protocol,
            "sasl.mechanism": self.mechanism,
            "sasl.username": self.username,
            "sasl.password": self.password,
        }

    def kafka_python(self) -> dict[str, Any]:
        """The keyword arguments for a kafka-python client."""
        if self.protocol == "PLAINTEXT":
            return {}
        return {
            "security_protocol": self.protocol,
            "sasl_mechanism": self.mechanism,
            "sasl_plain_username": self.username,
            "sasl_plain_password": self.password,
        }


def confluent_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """`config` with the environment's login settings added: every confluent-kafka client of the
    project is made from this."""
    return {**config, **KafkaAuth.from_env().confluent()}


def kafka_python_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """`config` (keyword arguments) with the environment's login settings added: every
    kafka-python client of the project is made from this."""
    return {**config, **KafkaAuth.from_env().kafka_python()}
