"""docker-compose.yml and bootstrap/Dockerfile: valid for docker-compose, one service per stage of the tiny
preset, scalable, and every command line parses with the real `swarmnode` CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from swarmnode.cli import main
from swarmnode.presets import get_preset

ROOT = Path(__file__).resolve().parents[1]
PEERS = "/swarm/peers.txt"


def resolved(*files: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The configuration of `files` as docker-compose resolves it (anchors merged, overrides applied,
    variables substituted, values normalised)."""
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (Debian: apt-get install -y docker-compose)")
    argv = [binary, *(a for f in files for a in ("-f", f)), "config"]
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})})
    assert run.returncode == 0, run.stderr
    return yaml.safe_load(run.stdout)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return resolved("docker-compose.yml")


def parse(command: list[str]) -> click.Context:
    """Parse a service's command with the real CLI (raises click errors for unknown flags or bad values)."""
    name, *args = command
    assert name in main.commands, f"{name!r} is not a swarmnode command"
    return main.commands[name].make_context(name, list(args))


def test_one_service_per_stage(compose: dict[str, Any]) -> None:
    stages = get_preset("tiny").n_stages
    expected = {"bootstrap", "data", *(f"stage{k}" for k in range(1, stages + 1))}
    assert set(compose["services"]) == expected


def test_services_share_one_image_and_the_peers_volume(compose: dict[str, Any]) -> None:
    assert "swarm" in compose["volumes"]
    for name, service in compose["services"].items():
        assert service["image"] == "swarmnode:local", name
        assert service["build"]["dockerfile"] == "bootstrap/Dockerfile", name
        assert any(volume.startswith("swarm:/swarm") for volume in service["volumes"]), name
        assert service["init"] is True, name  # reaps p2pd, forwards SIGTERM
        # Scalable with --scale: no fixed container name, no host port.
        assert "container_name" not in service and "ports" not in service, name


def test_bootstrap_writes_a_fresh_peers_file(compose: dict[str, Any]) -> None:
    bootstrap = compose["services"]["bootstrap"]
    params = parse(bootstrap["command"]).params
    assert params["host"] == "0.0.0.0" and params["peers_file"] == Path(PEERS)
    assert params["preset"] == "tiny" and not params["public"]
    entrypoint = bootstrap["entrypoint"]
    assert entrypoint[:2] == ["sh", "-c"] and f"rm -f {PEERS} && exec swarmnode" in entrypoint[2]
    assert bootstrap["healthcheck"]["test"] == ["CMD", "test", "-s", PEERS]


def test_stage_services_join_through_the_peers_file(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        if name == "bootstrap":
            continue
        assert service["command"][0] == "join", name
        params = parse(service["command"]).params
        assert params["stage"] == ("0" if name == "data" else name.removeprefix("stage")), name
        assert params["initial_peers"] == PEERS and params["host"] == "0.0.0.0" and not params["public"], name
        assert service["depends_on"] == {"bootstrap": {"condition": "service_healthy"}}, name
        assert service["restart"] == "on-failure", name


def test_loopback_override_keeps_every_service_on_loopback() -> None:
    """tests/compose/loopback.yml (the integration test's): the host's network, every daemon listening on
    127.0.0.1, the image and the run's steps from the environment; the rest as docker-compose.yml has it."""
    env = {"SWARMNODE_IMAGE": "swarmnode:test-x", "SWARMNODE_STEPS": "7"}
    merged = resolved("docker-compose.yml", "tests/compose/loopback.yml", env=env)
    assert set(merged["services"]) == set(resolved("docker-compose.yml")["services"])
    for name, service in merged["services"].items():
        assert service["network_mode"] == "host" and service["image"] == "swarmnode:test-x", name
        params = parse(service["command"]).params
        assert params["host"] == "127.0.0.1" and not params["public"] and not params["announce_maddrs"], name
    bootstrap = parse(merged["services"]["bootstrap"]["command"]).params
    assert bootstrap["steps"] == 7 and bootstrap["port"] == 0 and bootstrap["min_data_nodes"] == 2
    assert parse(merged["services"]["data"]["command"]).params["linger"]


def test_dockerfile_takes_its_base_and_torch_source_as_build_arguments() -> None:
    lines = (ROOT / "bootstrap" / "Dockerfile").read_text().splitlines()
    assert lines.index("ARG BASE=python:3.11-slim") < lines.index("FROM ${BASE}")
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in lines
    install = [line for line in lines if "pip install" in line and "requirements.txt" in line]
    assert len(install) == 1 and '${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"}' in install[0]
    assert "-c /tmp/deps/cpu.txt --find-links /tmp/deps" in install[0]
    assert (ROOT / "constraints" / "cpu.txt").is_file()
    assert 'ENTRYPOINT ["swarmnode"]' in lines
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "swarm-out"} <= set(ignored) and "wheels" not in ignored
