"""Hosts on one machine for tests that cross a real network: Linux network namespaces on a bridge.

`Hosts(n)` makes n namespaces, each with its own loopback and one interface ``eth0`` holding
``10.231.0.<i+1>/24``, all plugged into a bridge in a hub namespace (so nothing touches the
machine's own interfaces or routes). `rate_mbit` shapes every host's link with a token bucket
in both directions (the host's egress and the hub's egress towards it), which is what a home
uplink looks like to the swarm: its queue holds 1 MiB, within 100..500 ms of the rate (`queue_ms`). `cut(i)` / `heal(i)` take a host's link down and up: a network
partition with the process still running, unlike SIGSTOP (the kernel keeps answering TCP for
a stopped process; a cut link answers nothing).

`private=(i, ...)` puts those hosts behind NAT, each behind its own home router: the router's
namespace holds the host's address on the bridge (``10.231.0.<i+1>``, its "public" address) and
a LAN ``192.168.<i+1>.0/24`` towards the host (``.2``); it masquerades the host's outbound
connections (iptables MASQUERADE) and drops every connection that starts outside. So the host
can dial anyone and nobody can dial it, as behind a home router without port forwarding. The
link shaping then applies to the router's uplink. `nat_available()` says whether iptables works.

`congestion="cubic"` (or "reno", "bbr") gives the hosts' TCP that congestion control instead of
the machine's default (BBR here; most volunteers' Linux, Windows and macOS hosts run CUBIC). It
matters when both directions of a link are loaded at once, as in an all-reduce: one TCP flow each
way between two hosts at 20 Mbit/s took 1.32-1.35x the wire time under BBR, 1.08-1.15x under
CUBIC (`benchmarks/wire/allreduce_wan.py` prints this ceiling beside each all-reduce).

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
from collections.abc import Iterator
from contextlib import contextmanager
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


def nat_available() -> bool:
    """Whether NAT hosts can be built here: namespaces, and iptables (Debian's `iptables` package)."""
    return available() and shutil.which("iptables") is not None


def _run(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {result.stderr.strip()}")
    return result


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


QUEUE_BYTES = 1 << 20  # a home router's buffer (bytes), held to at least 100 ms and at most 500 ms of the rate


def queue_ms(rate_mbit: float) -> float:
    """How long the link's queue may hold packets: 1 MiB at the link rate, within 100..500 ms.

    A home uplink's buffer is sized in bytes and is deep (hundreds of ms at 10-20 Mbit/s:
    Kreibich et al., Netalyzr, IMC 2010). A 100 ms queue at every rate made the 20 Mbit/s links of
    `benchmarks/planner/plan_check.py` drop 10-30% of the segments their senders queued (this machine's TCP
    is BBR, which overfills a shallow queue; namespaces cannot change it): with the deeper queue,
    0.03-0.15% (all-reduces of 4 and 8 peers), at the same all-reduce times within the noise."""
    return min(max(QUEUE_BYTES * 8 / (rate_mbit * 1e6) * 1e3, 100.0), 500.0)


def _tc(ns: str, dev: str, rate_mbit: float) -> None:
    # A token bucket: `rate` sustained, a burst of 10 ms at that rate, a queue of `queue_ms`.
    rate = f"{rate_mbit}mbit"
    burst = max(int(rate_mbit * 1e6 / 8 * 0.01), 16 * 1024)
    result = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                             "rate", rate, "burst", str(burst), "latency", f"{queue_ms(rate_mbit):.0f}ms"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"tc on {ns}/{dev}: {result.stderr.strip()}")


@dataclass(frozen=True)
class Host:
    ns: str
    ip: str  # the address the host itself holds (behind NAT: its LAN address)
    hub_port: str  # the bridge port in the hub namespace that leads to this host (or its router)
    public_ip: str | None = None  # behind NAT: its router's address, what others see; None: `ip` itself

    def prefix(self) -> list[str]:
        """Prepend to a command to run it on this host (`ip netns exec` keeps the pid: signals reach it)."""
        return ["ip", "netns", "exec", self.ns]

    def maddr(self, port: int = 0) -> str:
        return f"/ip4/{self.ip}/tcp/{port}"


def _remove_orphans() -> None:
    """Delete namespaces of ours whose test process is gone."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in (line.split()[0] for line in listing.splitlines() if line.strip()):
        m = re.fullmatch(r"(?:dlp|nt)(\d+)-\w+", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


CONGESTION_KEY = "net.ipv4.tcp_congestion_control"


def congestion(ns: str | None = None) -> str:
    """The TCP congestion control of namespace `ns` (None: the machine's default)."""
    return _run(*(["ip", "netns", "exec", ns] if ns else []), "sysctl", "-n", CONGESTION_KEY).stdout.strip()


@contextmanager
def _congestion(name: str | None) -> Iterator[None]:
    """Namespaces created inside get TCP congestion control `name` (None: the machine's default).

    A new namespace copies the initial namespace's default, and this machine's kernel refuses to
    change it from inside one, so the default is switched for the creation only and restored."""
    if name is None:
        yield
        return
    before = congestion()
    _run("sysctl", "-q", "-w", f"{CONGESTION_KEY}={name}")
    try:
        yield
    finally:
        _run("sysctl", "-q", "-w", f"{CONGESTION_KEY}={before}")


class Hosts:
    def __init__(self, n: int, rate_mbit: float | list[float | None] | None = None, private: tuple[int, ...] = (),
                 tag: str = "dlp", congestion: str | None = None):
        """`rate_mbit`: every host's link rate, or one per host (None: that link unshaped)."""
        with _congestion(congestion):
            self._create(n, rate_mbit if isinstance(rate_mbit, list) else [rate_mbit] * n, private, tag)

    def _create(self, n: int, rates: list[float | None], private: tuple[int, ...], tag: str) -> None:
        _remove_orphans()
        self.tag = f"{tag}{os.getpid()}"
        self.hub = f"{self.tag}-hub"
        self.hosts: list[Host] = []
        self._namespaces: list[str] = []
        try:
            self._add_ns(self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i in range(n):
                uplink = f"{self.tag}-r{i}" if i in private else f"{self.tag}-h{i}"
                self._add_ns(uplink)
                _ip("link", "add", "eth0", "netns", uplink, "type", "veth", "peer", "name", f"p{i}", "netns", self.hub)
                _ip("-n", uplink, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
                _ip("-n", uplink, "link", "set", "eth0", "up")
                _ip("-n", self.hub, "link", "set", f"p{i}", "master", "br0")
                _ip("-n", self.hub, "link", "set", f"p{i}", "up")
                if rates[i] is not None:
                    _tc(uplink, "eth0", rates[i])
                    _tc(self.hub, f"p{i}", rates[i])
                if i in private:
                    host = Host(f"{self.tag}-h{i}", f"192.168.{i + 1}.2", f"p{i}", public_ip=f"{SUBNET}.{i + 1}")
                    self._add_ns(host.ns)
                    self._nat(uplink, host, i)
                else:
                    host = Host(uplink, f"{SUBNET}.{i + 1}", f"p{i}")
                self.hosts.append(host)
        except BaseException:
            self.close()
            raise

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._namespaces.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def _nat(self, router: str, host: Host, i: int) -> None:
        """Put `host` on a LAN behind `router`, which masquerades its outbound connections and
        drops every connection that starts on the outside (no port forwarding)."""
        _ip("link", "add", "eth0", "netns", host.ns, "type", "veth", "peer", "name", "lan0", "netns", router)
        _ip("-n", router, "addr", "add", f"192.168.{i + 1}.1/24", "dev", "lan0")
        _ip("-n", router, "link", "set", "lan0", "up")
        _ip("-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        _ip("-n", host.ns, "link", "set", "eth0", "up")
        _ip("-n", host.ns, "route", "add", "default", "via", f"192.168.{i + 1}.1")
        ex = ["ip", "netns", "exec", router]
        _run(*ex, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        _run(*ex, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "eth0", "-j", "MASQUERADE")
        _run(*ex, "iptables", "-A", "FORWARD", "-i", "eth0", "-o", "lan0", "-m", "conntrack", "--ctstate",
             "ESTABLISHED,RELATED", "-j", "ACCEPT")
        _run(*ex, "iptables", "-A", "FORWARD", "-i", "eth0", "-o", "lan0", "-j", "DROP")
        _run(*ex, "iptables", "-A", "INPUT", "-i", "eth0", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
             "-j", "ACCEPT")
        _run(*ex, "iptables", "-A", "INPUT", "-i", "eth0", "-j", "DROP")

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
