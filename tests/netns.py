"""Hosts on one machine for tests that cross a real network: Linux network namespaces on a bridge.

`Hosts(n)` makes n namespaces, each with its own loopback and one interface ``eth0`` holding
``10.231.0.<i+1>/24``, all plugged into a bridge in a hub namespace (so nothing touches the
machine's own interfaces or routes). `rate_mbit` shapes every host's link with a token bucket
in both directions (the host's egress and the hub's egress towards it), which is what a home
uplink looks like to the swarm. `cut(i)` / `heal(i)` take a host's link down and up: a network
partition with the process still running, unlike SIGSTOP (the kernel keeps answering TCP for
a stopped process; a cut link answers nothing).

Needs root and iproute2 (`ip`, `tc`); `available()` says whether this machine has them. Every
namespace is deleted on exit (deleting a namespace removes its interfaces and qdiscs), also
after a failed test; namespaces left by a test process that was killed outright (their names
carry its pid) are deleted by the next `Hosts`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

SUBNET = "10.231.0"


def available() -> bool:
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        return False
    probe = f"dlp-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return made


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def _tc(ns: str, dev: str, rate_mbit: float) -> None:
    # A token bucket: `rate` sustained, a burst of 10 ms at that rate, at most 100 ms queued.
    rate = f"{rate_mbit}mbit"
    burst = max(int(rate_mbit * 1e6 / 8 * 0.01), 16 * 1024)
    result = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                             "rate", rate, "burst", str(burst), "latency", "100ms"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"tc on {ns}/{dev}: {result.stderr.strip()}")


@dataclass(frozen=True)
class Host:
    ns: str
    ip: str
    hub_port: str  # the bridge port in the hub namespace that leads to this host

    def prefix(self) -> list[str]:
        """Prepend to a command to run it on this host (`ip netns exec` keeps the pid: signals reach it)."""
        return ["ip", "netns", "exec", self.ns]

    def maddr(self, port: int = 0) -> str:
        return f"/ip4/{self.ip}/tcp/{port}"


def _remove_orphans() -> None:
    """Delete namespaces of ours whose test process is gone."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in (line.split()[0] for line in listing.splitlines() if line.strip()):
        m = re.fullmatch(r"dlp(\d+)-\w+", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


class Hosts:
    def __init__(self, n: int, rate_mbit: float | None = None):
        _remove_orphans()
        self.tag = f"dlp{os.getpid()}"
        self.hub = f"{self.tag}-hub"
        self.hosts: list[Host] = []
        self._namespaces: list[str] = []
        try:
            self._add_ns(self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i in range(n):
                host = Host(ns=f"{self.tag}-h{i}", ip=f"{SUBNET}.{i + 1}", hub_port=f"p{i}")
                self._add_ns(host.ns)
                _ip("link", "add", "eth0", "netns", host.ns, "type", "veth", "peer", "name", host.hub_port,
                    "netns", self.hub)
                _ip("-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
                _ip("-n", host.ns, "link", "set", "eth0", "up")
                _ip("-n", self.hub, "link", "set", host.hub_port, "master", "br0")
                _ip("-n", self.hub, "link", "set", host.hub_port, "up")
                if rate_mbit is not None:
                    _tc(host.ns, "eth0", rate_mbit)
                    _tc(self.hub, host.hub_port, rate_mbit)
                self.hosts.append(host)
        except BaseException:
            self.close()
            raise

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._namespaces.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def cut(self, i: int) -> None:
        """Partition host i: its link goes down (packets to and from it are dropped)."""
        _ip("-n", self.hub, "link", "set", self.hosts[i].hub_port, "down")

    def heal(self, i: int) -> None:
        _ip("-n", self.hub, "link", "set", self.hosts[i].hub_port, "up")

    def close(self) -> None:
        for ns in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._namespaces.clear()

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
