"""compose.ci.yaml changes where compose.yaml's services run, never what they do.

The override restates commands (a Compose override replaces a command whole) with loopback
addresses; these checks keep the restated commands equal to compose.yaml's but for their
addresses (the live pipeline's producer and trainer included), and make a service added to
compose.yaml fail here until CI runs it on the host network from a local image too. No Docker
needed.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]


class _ComposeLoader(yaml.SafeLoader):
    """SafeLoader that reads Compose's `!reset` and `!override` merge tags as plain values."""


def _tagged(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node)
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node)
    return loader.construct_scalar(node)


_ComposeLoader.add_constructor("!reset", _tagged)
_ComposeLoader.add_constructor("!override", _tagged)


def services(name: str) -> dict[str, dict[str, Any]]:
    data = yaml.load((REPO / name).read_text(), Loader=_ComposeLoader)
    found: dict[str, dict[str, Any]] = data["services"]
    return found


def without_addresses(command: list[str] | str) -> list[str]:
    """The command with every host:port, URL authority and --host/--port value blanked."""
    words = command.split() if isinstance(command, str) else list(command)
    for i, word in enumerate(words):
        if i > 0 and words[i - 1] in ("--host", "--port"):
            words[i] = "ADDRESS"
        else:
            words[i] = re.sub(r"(kafka|https?)://[^/\s\"]+", r"\1://ADDRESS", word)
    return words


BASE = services("compose.yaml")
CI = services("compose.ci.yaml")


def test_every_service_runs_on_the_host_network_from_a_local_image() -> None:
    for name, base in BASE.items():
        ci = CI.get(name, {})
        assert ci.get("network_mode") == "host", f"{name}: compose.ci.yaml must set host networking"
        image = ci.get("image", base.get("image"))
        built_here = "build" in base or "build" in ci
        assert built_here or str(image).startswith("checknrun-ci/"), (
            f"{name}: CI cannot pull {image}; give it a local image in compose.ci.yaml"
        )
        assert ci.get("pull_policy") == "never", f"{name}: CI must never try a registry"
        if "ports" in base:
            assert ci.get("ports") == [], f"{name}: host networking publishes no ports (!reset)"


def test_restated_commands_differ_only_in_their_addresses() -> None:
    restated = [name for name in CI if "command" in CI[name] and "command" in BASE[name]]
    assert {"minio-init", "producer", "trainer", "server-1", "server-2"} <= set(restated)
    for name in restated:
        if name == "minio":
            continue  # its command is nothing but addresses
        assert without_addresses(CI[name]["command"]) == without_addresses(BASE[name]["command"]), (
            name
        )


def test_every_address_in_ci_is_loopback() -> None:
    text = (REPO / "compose.ci.yaml").read_text()
    hosts = re.findall(r"([\w.-]+):\$\{CHECKNRUN_CI_\w+_PORT", text)
    assert hosts, "no address found: has the port naming changed?"
    assert set(hosts) == {"127.0.0.1"}
    for name, ci in CI.items():
        command = ci.get("command", [])
        words = command.split() if isinstance(command, str) else command
        for flag, value in itertools.pairwise(words):
            if flag in ("--host", "--address", "--console-address"):
                assert value.startswith("127.0.0.1"), (name, flag, value)
