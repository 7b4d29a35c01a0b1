"""The compose swarm for real: docker-compose.yml, scaled to 2 data nodes and 2 replicas of stage 2, trains in
containers of the bootstrap/Dockerfile image, and `swarmnode status` inside a container sees the whole swarm.

Image registries cannot be reached from the test machines, so the base image is made from Debian's packages
(`debootstrap --variant=minbase`, the host's CA bundle for pip) and the CPU torch wheel comes from where pip
finds it on this machine (its find-links), copied into the build context. Both images are tagged by a digest
of their inputs and reused when one with that tag exists. `tests/compose/loopback.yml` puts every service on
the host's network listening on 127.0.0.1, so all traffic stays on loopback. Skipped, with the reason, where
Docker cannot run (no engine answering, or neither the base image nor debootstrap).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from swarm_harness import HarnessError, event_objects, poll

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILES = ("docker-compose.yml", "tests/compose/loopback.yml")
STEPS = 8
STATUS_SETTLE_S = 30.0  # how long the status read may take to show every node at the last step
SCALE = {"data": 2, "stage2": 2}

SUITE = "bookworm"  # Debian 12: python3 is 3.11, as the project's
MIRROR = "http://deb.debian.org/debian"
PACKAGES = ("python3", "python3-venv", "passwd")  # python3-venv brings pip (ensurepip)
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# what bootstrap/Dockerfile copies from the build context (besides the torch wheel)
CONTEXT_FILES = ("bootstrap/Dockerfile", "pyproject.toml", "setup.py", "README.md", "constraints/cpu.txt")
CONTEXT_FOLDERS = ("swarmnode", "protocols")
COMMAND_TIMEOUT_S = 900.0
MAX_RESTARTS = 3


class DockerFailed(RuntimeError):
    """A docker or docker-compose command failed."""


def sh(argv: list[str], timeout: float = COMMAND_TIMEOUT_S, **kwargs: Any) -> str:
    """Run `argv`; its stdout, or DockerFailed with the tail of what it printed."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        raise DockerFailed(f"{' '.join(argv[:4])} ... exited {done.returncode}:\n{tail}")
    return done.stdout


def digest(parts: Iterable[tuple[str, bytes]]) -> str:
    """A short digest of named byte strings (an image's inputs)."""
    hasher = hashlib.sha256()
    for name, data in parts:
        hasher.update(f"{name}\0{len(data)}\0".encode())
        hasher.update(data)
    return hasher.hexdigest()[:16]


def image_exists(tag: str) -> bool:
    done = subprocess.run(["docker", "image", "inspect", tag], capture_output=True, timeout=60)
    return done.returncode == 0


def compose_binary() -> list[str] | None:
    """docker-compose (Debian's), else the `docker compose` plugin."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    plugin = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=60)
    return ["docker", "compose"] if plugin.returncode == 0 else None


def docker_or_skip() -> list[str]:
    """The compose command, or a skip saying why Docker cannot run here."""
    if shutil.which("docker") is None:
        pytest.skip("Docker is not installed (Debian: apt-get install -y docker.io)")
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        why = (info.stderr.strip().splitlines() or ["no answer"])[-1]
        pytest.skip(f"no Docker engine answers (start dockerd as root): {why}")
    compose = compose_binary()
    if compose is None:
        pytest.skip("docker-compose is not installed (Debian: apt-get install -y docker-compose)")
    return compose


def base_image(work: Path) -> str:
    """Debian minbase with python3 and the host's CA bundle (pip in the image trusts what the host does)."""
    recipe = [(name, value.encode()) for name, value in (("suite", SUITE), ("mirror", MIRROR))]
    recipe += [("packages", " ".join(PACKAGES).encode()), ("ca", CA_BUNDLE.read_bytes())]
    tag = f"swarmnode-base:{digest(recipe)}"
    if image_exists(tag):
        return tag
    if shutil.which("debootstrap") is None or os.geteuid() != 0:
        pytest.skip(f"no image {tag}, and no debootstrap (as root) to make it: apt-get install debootstrap")
    rootfs = work / "rootfs"
    try:
        include = ",".join(PACKAGES)
        sh(["debootstrap", "--variant=minbase", f"--include={include}", SUITE, str(rootfs), MIRROR])
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            shutil.rmtree(rootfs / cache)
        (rootfs / "etc/ssl/certs").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(CA_BUNDLE, rootfs / "etc/ssl/certs/ca-certificates.crt")
        changes = [f"ENV PIP_CERT={CA_BUNDLE}", 'CMD ["python3"]']
        with subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE) as tar:
            sh(["docker", "import", *(f"--change={c}" for c in changes), "-", tag], stdin=tar.stdout)
        if tar.returncode != 0:
            raise DockerFailed(f"tar of {rootfs} exited {tar.returncode}")
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)
    return tag


def context_inputs() -> list[tuple[str, Path]]:
    """The files bootstrap/Dockerfile copies: (path in the context, file here). Not the planner's event loop
    compiled in place for this machine's Python (`*.so`): the image builds its own, or runs the loop in
    Python."""
    files = [(name, ROOT / name) for name in CONTEXT_FILES]
    for folder in CONTEXT_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".so":
                files.append((path.relative_to(ROOT).as_posix(), path))
    return files


def cpu_torch_wheel(folder: Path) -> Path | None:
    """The CPU torch wheel of constraints/cpu.txt where pip finds it on this machine without an index (its
    find-links), downloaded into `folder`; None if there is none."""
    pins = (ROOT / "constraints/cpu.txt").read_text().split()
    (pin,) = (line for line in pins if line.startswith("torch=="))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-index", "-d", str(folder), pin],
        capture_output=True,
        timeout=300,
    )
    wheels = sorted(folder.glob("torch-*+cpu-*.whl"))
    return wheels[0] if done.returncode == 0 and wheels else None


def swarmnode_image(work: Path, base: str) -> str:
    """bootstrap/Dockerfile built on `base` with the CPU torch wheel from this machine (or, with none here,
    from PyTorch's CPU index, the Dockerfile's default)."""
    wheels = work / "wheels"
    wheels.mkdir()
    wheel = cpu_torch_wheel(wheels)
    inputs = context_inputs()
    source = ("torch", wheel.name.encode()) if wheel else ("torch", b"the Dockerfile's TORCH_INDEX")
    files = [(name, path.read_bytes()) for name, path in inputs]
    tag = f"swarmnode:test-{digest([('base', base.encode()), source, *files])}"
    if image_exists(tag):
        return tag
    context = work / "context"
    for name, path in inputs:
        (context / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, context / name)
    args = ["--build-arg", f"BASE={base}"]
    if wheel is not None:
        shutil.move(wheels, context / "wheels")
        args += ["--build-arg", "TORCH_INDEX="]
    build = ["docker", "build", "--network", "host", "-f", "bootstrap/Dockerfile", *args, "-t", tag, "."]
    try:
        sh(build, cwd=context)
    finally:
        shutil.rmtree(context, ignore_errors=True)
    return tag


class ComposeProject:
    """One docker-compose project of the swarm: docker-compose.yml and the loopback override."""

    def __init__(self, compose: list[str], image: str) -> None:
        self.name = f"swarmnode-test-{secrets.token_hex(4)}"
        self.argv = [*compose, "-p", self.name, *(a for f in COMPOSE_FILES for a in ("-f", str(ROOT / f)))]
        self.env = {**os.environ, "SWARMNODE_IMAGE": image, "SWARMNODE_STEPS": str(STEPS)}

    def __call__(self, *args: str, timeout: float = COMMAND_TIMEOUT_S) -> str:
        return sh([*self.argv, *args], timeout=timeout, cwd=ROOT, env=self.env)

    def containers(self, service: str | None = None) -> list[str]:
        return self("ps", "-q", *([service] if service else [])).split()

    def events(self, container: str) -> list[dict[str, Any]]:
        """The JSON event lines a container printed so far (stdout only)."""
        done = subprocess.run(["docker", "logs", container], capture_output=True, text=True, timeout=60)
        return event_objects(done.stdout.splitlines(), container)

    def states(self) -> dict[str, tuple[int, bool]]:
        """Each container's restarts and whether it runs (one `docker inspect` for all)."""
        template = "{{.Id}} {{.RestartCount}} {{.State.Running}}"
        lines = sh(["docker", "inspect", "-f", template, *self.containers()], 60).splitlines()
        return {c: (int(n), running == "true") for c, n, running in (line.split() for line in lines)}

    def check_no_crash_loop(self) -> None:
        """Raise, with every service's last lines, if a container keeps failing. A daemon that failed once
        (on a loaded machine its p2p daemon may not start in time) is restarted by `restart: on-failure`."""
        looping = {c[:12]: n for c, (n, _) in self.states().items() if n > MAX_RESTARTS}
        if looping:
            raise DockerFailed(f"containers restarted over and over: {looping}\n{self.logs()}")

    def logs(self) -> str:
        return self("logs", "--no-color", "--tail", "15", timeout=60)


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], str]:
    """The compose command and the swarmnode image (built, or reused)."""
    compose = docker_or_skip()
    work = tmp_path_factory.mktemp("docker")
    return compose, swarmnode_image(work, base_image(work))


@pytest.fixture
def project(image: tuple[list[str], str]) -> Iterator[ComposeProject]:
    """A compose project, taken down with its volume however the test ends."""
    compose = ComposeProject(*image)
    try:
        yield compose
    finally:
        compose("down", "-v", "--remove-orphans", "--timeout", "10", timeout=300)


def finished(project: ComposeProject, containers: list[str]) -> Callable[[], list[dict[str, Any]] | None]:
    def check() -> list[dict[str, Any]] | None:
        done = [[e for e in project.events(c) if e["event"] == "finished"] for c in containers]
        return [events[0] for events in done] if all(done) else None

    return check


def test_the_build_context_holds_what_the_dockerfile_copies() -> None:
    """Every source of a COPY in bootstrap/Dockerfile is in the context `swarmnode_image` builds in (the
    torch wheels aside), so the image is built from the inputs its tag is a digest of."""
    lines = (ROOT / "bootstrap/Dockerfile").read_text().splitlines()
    sources = {src for line in lines if line.startswith("COPY ") for src in line.split()[1:-1]}
    assert "wheel[s]" in sources and "swarmnode" in sources
    assert sources - {"wheel[s]"} <= {*CONTEXT_FILES, *CONTEXT_FOLDERS}, sources


@pytest.mark.integration
@pytest.mark.timeout(1800)
def test_scaled_compose_swarm_trains_on_loopback(project: ComposeProject) -> None:
    scale = [a for service, n in SCALE.items() for a in ("--scale", f"{service}={n}")]
    project("up", "-d", "--no-build", *scale)
    data = project.containers("data")
    assert len(data) == SCALE["data"]

    try:
        ends = poll(
            finished(project, data), 600, "both data nodes' last step", 5.0, project.check_no_crash_loop
        )
    except HarnessError as error:
        raise DockerFailed(f"{error}\n{project.logs()}") from None
    assert [end["step"] for end in ends] == [STEPS] * len(data)
    for container in data:
        losses = [e["loss"] for e in project.events(container) if e["event"] == "step"]
        assert len(losses) == STEPS and losses[-1] < losses[0], losses

    # every address any daemon listens on or was dialed at is on loopback
    peers = project("exec", "-T", "bootstrap", "cat", "/swarm/peers.txt", timeout=60).split()
    assert peers and all(p.startswith("/ip4/127.0.0.1/tcp/") for p in peers), peers
    for container in project.containers():
        for event in project.events(container):
            if event["event"] == "reachability":
                assert event["address"].startswith("/ip4/127.0.0.1/"), event

    # `swarmnode status` from inside a container: the whole swarm, every node at the last step (the data
    # nodes linger after it). A stage replica the last tick's plan sent nothing takes the clock from the data
    # nodes' records (once a second), so its record can show the step before for a moment: read again until
    # every record shows the last step, for at most STATUS_SETTLE_S
    settle_by = time.monotonic() + STATUS_SETTLE_S
    while True:
        status = project(
            "exec", "-T", "bootstrap", "swarmnode", "status", "--initial-peers", "/swarm/peers.txt", "--json",
            timeout=120,
        )  # fmt: skip
        summary = json.loads(status.strip().splitlines()[-1])
        steps = [p["step"] for s in summary["stages"] for p in s["peers"] if p["state"] == "online"]
        if all(step == STEPS for step in steps) or time.monotonic() > settle_by:
            break
    assert summary["complete"] and summary["run"]["total_steps"] == STEPS, summary
    online = {s["stage"]: [p for p in s["peers"] if p["state"] == "online"] for s in summary["stages"]}
    assert {k: len(peers) for k, peers in online.items()} == {0: 2, 1: 1, 2: 2, 3: 1}, summary
    assert all(p["step"] == STEPS for peers in online.values() for p in peers), summary
    assert all(running for _, running in project.states().values())
