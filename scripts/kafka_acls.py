"""Kafka's users for checknrun and what each may do: compose.yaml's kafka-init runs it as the admin.

    CHECKNRUN_KAFKA_BOOTSTRAP=HOST:PORT \\
    CHECKNRUN_KAFKA_USERNAME=admin CHECKNRUN_KAFKA_PASSWORD=... \\
    CHECKNRUN_KAFKA_TRAINER_PASSWORD=... CHECKNRUN_KAFKA_SERVER_PASSWORD=... \\
    CHECKNRUN_KAFKA_PRODUCER_PASSWORD=... \\
        python scripts/kafka_acls.py \\
            --events checknrun.events --announcements checknrun.announcements

Creates (or updates the password of) the SCRAM-SHA-512 users `trainer`, `server` and `producer`
and allows each, on its topics only (literal names), what checknrun's clients send:

    producer   topic events: CREATE (with its partitions), WRITE, DESCRIBE
    trainer    topic events: READ, DESCRIBE (partitions assigned, no offsets committed)
               group checknrun-trainer: DESCRIBE (librdkafka looks its coordinator up; the
                   group is never joined)
               topic announcements: CREATE, WRITE, DESCRIBE
    server     topic announcements: READ, DESCRIBE (assigned, no group at all)

Anything else (a server writing events, anyone without a login) the broker refuses, given
`allow.everyone.if.no.acl.found=false`. Every step may run again: an existing user gets the
password given, an existing ACL stays. The admin's own login comes from the client settings
every checknrun client reads (publisher/bus/kafka_auth.py). Exits 1 with the broker's answer
when a step fails.
"""

from __future__ import annotations

import argparse
import os
import sys

from confluent_kafka import KafkaException
from confluent_kafka.admin import (
    AclBinding,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialUpsertion,
)

from publisher.bus import confluent_config

USERS = ("trainer", "server", "producer")
SCRAM_ITERATIONS = 8192
TIMEOUT_S = 30.0


#: the consumer group the trainer's reader names (trainer/streams/kafka_reader.py).
TRAINER_GROUP = "checknrun-trainer"


def allowed(events: str, announcements: str) -> dict[str, dict[tuple[str, str], tuple[str, ...]]]:
    """user -> (resource type, name) -> what it may do there (the module docstring's table)."""
    return {
        "producer": {("TOPIC", events): ("CREATE", "WRITE", "DESCRIBE")},
        "trainer": {
            ("TOPIC", events): ("READ", "DESCRIBE"),
            ("GROUP", TRAINER_GROUP): ("DESCRIBE",),
            ("TOPIC", announcements): ("CREATE", "WRITE", "DESCRIBE"),
        },
        "server": {("TOPIC", announcements): ("READ", "DESCRIBE")},
    }


def bindings(events: str, announcements: str) -> list[AclBinding]:
    return [
        AclBinding(
            ResourceType[kind],
            name,
            ResourcePatternType.LITERAL,
            f"User:{user}",
            "*",
            AclOperation[operation],
            AclPermissionType.ALLOW,
        )
        for user, resources in allowed(events, announcements).items()
        for (kind, name), operations in resources.items()
        for operation in operations
    ]


def passwords() -> dict[str, str]:
    found = {user: os.environ.get(f"CHECKNRUN_KAFKA_{user.upper()}_PASSWORD", "") for user in USERS}
    missing = [f"CHECKNRUN_KAFKA_{user.upper()}_PASSWORD" for user, pw in found.items() if not pw]
    if missing:
        sys.exit(f"kafka_acls: set {', '.join(missing)}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", required=True, help="the events topic")
    parser.add_argument("--announcements", required=True, help="the announcements topic")
    args = parser.parse_args()
    bootstrap = os.environ.get("CHECKNRUN_KAFKA_BOOTSTRAP", "")
    if not bootstrap:
        sys.exit("kafka_acls: set CHECKNRUN_KAFKA_BOOTSTRAP=HOST:PORT")
    admin = AdminClient(confluent_config({"bootstrap.servers": bootstrap}))
    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, SCRAM_ITERATIONS)
    upserts = [
        UserScramCredentialUpsertion(user, info, password.encode())
        for user, password in passwords().items()
    ]
    acls = bindings(args.events, args.announcements)
    try:
        for user, future in admin.alter_user_scram_credentials(upserts).items():
            future.result(timeout=TIMEOUT_S)
            print(f"kafka_acls: user {user} (SCRAM-SHA-512)", flush=True)
        for future in admin.create_acls(acls).values():
            future.result(timeout=TIMEOUT_S)
        print(f"kafka_acls: {len(acls)} ACLs for {', '.join(USERS)}", flush=True)
    except KafkaException as exc:
        sys.exit(f"kafka_acls: the broker at {bootstrap} refused: {exc}")


if __name__ == "__main__":
    main()
