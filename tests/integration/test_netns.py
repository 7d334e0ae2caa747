"""The namespace hosts of the network tests and benchmarks: a chosen TCP congestion control.

`netns.Hosts(congestion=...)` switches the machine's default for the namespaces' creation only:
the hosts must hold the one asked for, and the machine's default must be back afterwards (also
when creating the hosts fails), or every later test and process on the machine would inherit it.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests import netns

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not netns.available(), reason="needs root and iproute2 for network namespaces"),
]


def another() -> str:
    """An allowed congestion control other than the machine's default (skips where the default
    cannot be changed: no sysctl, or no permission to write it)."""
    if shutil.which("sysctl") is None:
        pytest.skip("needs sysctl")
    rewrite = subprocess.run(["sysctl", "-q", "-w", f"{netns.CONGESTION_KEY}={netns.congestion()}"], capture_output=True)
    if rewrite.returncode != 0:
        pytest.skip("the machine's TCP congestion control cannot be changed here")
    allowed = subprocess.run(["sysctl", "-n", "net.ipv4.tcp_allowed_congestion_control"], capture_output=True,
                             text=True, check=True).stdout.split()
    other = next((cc for cc in allowed if cc != netns.congestion()), None)
    if other is None:
        pytest.skip(f"only {netns.congestion()} is allowed on this machine")
    return other


def test_hosts_get_the_congestion_control_asked_and_the_machine_keeps_its_own():
    other = another()
    before = netns.congestion()
    with netns.Hosts(2, congestion=other) as hosts:
        assert [netns.congestion(h.ns) for h in hosts.hosts] == [other, other]
        assert netns.congestion() == before
    with netns.Hosts(1) as hosts:  # no choice: the machine's default
        assert netns.congestion(hosts[0].ns) == before


def test_the_default_comes_back_when_the_hosts_cannot_be_made(monkeypatch):
    other = another()
    before = netns.congestion()

    def refuse(ns: str, dev: str, rate_mbit: float) -> None:
        raise RuntimeError(f"tc on {ns}/{dev}: refused")

    monkeypatch.setattr(netns, "_tc", refuse)  # fails after the switch, with namespaces half made
    with pytest.raises(RuntimeError, match="refused"):
        netns.Hosts(1, rate_mbit=10, congestion=other, tag="nt")
    assert netns.congestion() == before
    assert f"nt{os.getpid()}-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    with pytest.raises(RuntimeError, match="no-such"):
        netns.Hosts(1, congestion="no-such-algorithm")
    assert netns.congestion() == before
