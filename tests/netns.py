"""Private networks of Linux network namespaces for integration tests (root and `ip netns` needed).

    with Network() as net:
        boot = net.host("boot")                  # a namespace on the shared segment, 10.X.0.n/24
        home = net.host_behind_nat("home")       # a namespace on a LAN behind a masquerading router
        net.exec_argv(home, ["python", ...])     # argv that runs the command inside the namespace

Every namespace, veth and iptables rule lives only in namespaces this object creates: one "switch"
namespace holds a bridge, each host's veth pair is created directly between its namespace and the switch,
and the NAT router's rules are written inside the router's namespace. The host's own interfaces are never
touched. Names carry a random tag, so concurrent runs do not collide; `close` (also on any failure while
building) deletes the namespaces, which removes their veths and rules with them.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

_PREFIX = "swn"  # namespace and interface names: swn<tag>...
_REPLIES = ("-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED")  # packets of connections made from inside


class NetnsUnavailable(RuntimeError):
    """This machine cannot build namespaces for tests (not root, or no `ip netns`/`iptables`)."""


def unavailable_reason() -> str | None:
    """Why network-namespace tests cannot run here, or None if they can."""
    if os.geteuid() != 0:
        return "network-namespace tests need root (CI runs them as root)"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"network-namespace tests need `{tool}`"
    probe = f"{_PREFIX}{secrets.token_hex(3)}probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()[:200]}"
    try:
        rule = ["iptables", "-A", "INPUT", *_REPLIES, "-j", "ACCEPT"]
        done = subprocess.run(["ip", "netns", "exec", probe, *rule], capture_output=True, text=True)
        if done.returncode != 0:
            return f"iptables (conntrack) fails in a namespace here: {done.stderr.strip()[:200]}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass(frozen=True)
class Host:
    """One namespace with one address; `gateway` is its default route (None: the segment only)."""

    namespace: str
    address: str
    gateway: str | None = None


class Network:
    """A switched segment 10.<b>.0.0/24 for public hosts, plus NAT routers each with a LAN 10.<b>.<n>.0/24."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(3)
        self._subnet = 100 + secrets.randbelow(150)  # second octet: 10.<b>.x.y, inside our namespaces only
        self.namespaces: list[str] = []
        self._routers: set[str] = set()
        self._hosts = 0
        self._lans = 0
        try:
            self.switch = self._namespace("sw")
            self._ip(self.switch, "link", "add", "br0", "type", "bridge")
            self._ip(self.switch, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- building -------------------------------------------------------------------------------------

    def _namespace(self, role: str) -> str:
        name = f"{_PREFIX}{self.tag}{role}"
        _run(["ip", "netns", "add", name])
        self.namespaces.append(name)
        self._ip(name, "link", "set", "lo", "up")
        return name

    def _ip(self, namespace: str, *args: str) -> None:
        _run(["ip", "-n", namespace, *args])

    def _veth(self, a: str, a_name: str, b: str, b_name: str) -> None:
        """A veth pair created directly between namespaces `a` and `b` (never in the host's namespace)."""
        _run(["ip", "link", "add", a_name, "netns", a, "type", "veth", "peer", "name", b_name, "netns", b])
        self._ip(a, "link", "set", a_name, "up")
        self._ip(b, "link", "set", b_name, "up")

    def _attach(self, namespace: str, device: str, address: str, prefix: int = 24) -> None:
        """Wire `namespace` to the switch through `device` at `address` on the public segment."""
        port = f"p{self.tag}{len(self.namespaces)}"
        self._veth(namespace, device, self.switch, port)
        self._ip(self.switch, "link", "set", port, "master", "br0")
        self._ip(namespace, "addr", "add", f"{address}/{prefix}", "dev", device)

    def host(self, role: str) -> Host:
        """A namespace on the public segment (reachable by every other host of this network)."""
        namespace = self._namespace(role)
        self._hosts += 1
        address = f"10.{self._subnet}.0.{self._hosts}"
        self._attach(namespace, "eth0", address)
        return Host(namespace, address)

    def host_behind_nat(self, role: str) -> Host:
        """A namespace on its own LAN behind a router namespace that masquerades its outbound connections
        and forwards nothing inbound except replies to them: it can reach the public segment, and no host
        there can open a connection to it."""
        self._lans += 1
        lan = f"10.{self._subnet}.{self._lans}"
        router = self._namespace(f"{role}rt")
        self._routers.add(router)
        self._attach(router, "wan", f"10.{self._subnet}.0.{250 - self._lans}")
        namespace = self._namespace(role)
        self._veth(router, "lan", namespace, "eth0")
        self._ip(router, "addr", "add", f"{lan}.1/24", "dev", "lan")
        self._ip(namespace, "addr", "add", f"{lan}.2/24", "dev", "eth0")
        self._ip(namespace, "route", "add", "default", "via", f"{lan}.1")
        _run(["ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        for rule in (
            ["-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE"],
            ["-A", "FORWARD", "-i", "lan", "-o", "wan", "-j", "ACCEPT"],
            ["-A", "FORWARD", "-i", "wan", "-o", "lan", *_REPLIES, "-j", "ACCEPT"],
            ["-P", "FORWARD", "DROP"],
            # as many home routers do: inbound connections to the router itself vanish, unanswered
            [
                "-A",
                "INPUT",
                "-i",
                "wan",
                "-m",
                "conntrack",
                "--ctstate",
                "ESTABLISHED,RELATED",
                "-j",
                "ACCEPT",
            ],
            ["-A", "INPUT", "-i", "wan", "-j", "DROP"],
        ):
            _run(["ip", "netns", "exec", router, "iptables", *rule])
        return Host(namespace, f"{lan}.2", gateway=f"{lan}.1")

    # ---- using ----------------------------------------------------------------------------------------

    @staticmethod
    def exec_argv(host: Host, argv: Sequence[str]) -> list[str]:
        """`argv` run inside `host`'s namespace (`ip netns exec` execs it: the pid stays the command's)."""
        return ["ip", "netns", "exec", host.namespace, *argv]

    def close(self) -> None:
        """Delete every namespace made (their veths and iptables rules go with them), newest first."""
        for name in reversed(self.namespaces):
            with contextlib.suppress(subprocess.CalledProcessError):
                if name in self._routers:
                    _run(["ip", "netns", "exec", name, "iptables", "-F"])
                    _run(["ip", "netns", "exec", name, "iptables", "-t", "nat", "-F"])
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.namespaces.clear()

    def leftovers(self) -> list[str]:
        """Namespaces of this network that still exist (empty after a clean `close`)."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return [line.split()[0] for line in listed.splitlines() if line.startswith(f"{_PREFIX}{self.tag}")]


def _run(argv: Sequence[str]) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, list(argv), done.stdout, done.stderr)
