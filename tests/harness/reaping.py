"""Find and kill every process a test started, wherever it went.

A process group is not enough: a node's forked DHT process and its `p2pd` survive the node's
SIGKILL, and a process that calls `setsid` leaves the group altogether; both are reparented to
init. So every process the harness starts carries a marker in its environment (`PROC_VAR`, one
token per process; exec'd and forked descendants inherit it), and this test session sets
`SESSION_VAR` in its own environment, which every process it or its children exec inherit.
Reaping a marker kills every live process whose environment holds it. At the end of the session
`reap_session` also kills the descendants of the pytest process itself (forked in-process DHTs
carry the environment pytest was started with, without the marker). Linux only (/proc).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterable

SESSION_VAR = "DILOCO_TEST_SESSION"
PROC_VAR = "DILOCO_TEST_PROC"
# Helpers of the test process itself that are not ours to kill: torch's shared-memory manager
# (comm truncated to 15 chars) and multiprocessing's resource tracker / fork server.
_SPARED = ("torch_shm_manage", "multiprocessing.resource_tracker", "multiprocessing.forkserver")


def new_token() -> str:
    return uuid.uuid4().hex


def session_token() -> str:
    """This session's marker value, set in os.environ on first use (conftest does it at import).
    A pytest-xdist worker is a session of its own: it takes its own token, not the one inherited
    from the controller, which every worker carries (the first to finish would reap the others)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and not os.environ.get(SESSION_VAR, "").startswith(f"{worker}-"):
        os.environ[SESSION_VAR] = f"{worker}-{os.getpid()}-{new_token()}"
    return os.environ.setdefault(SESSION_VAR, f"{os.getpid()}-{new_token()}")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, or None when it is gone."""
    try:
        stat = _read(f"/proc/{pid}/stat").decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """Running or stopped: a zombie (dead, not yet waited for) does not count."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def _spared(pid: int) -> bool:
    try:
        cmdline = _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace")
        comm = _read(f"/proc/{pid}/comm").decode(errors="replace").strip()
    except OSError:
        return True
    return any(name in cmdline or name == comm for name in _SPARED)


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def marked(var: str, value: str) -> list[int]:
    """Live processes (not this one) whose environment holds `var=value`."""
    needle = f"{var}={value}".encode()
    found = []
    for pid in _pids():
        if pid == os.getpid():
            continue
        try:
            env = _read(f"/proc/{pid}/environ").split(b"\0")
        except OSError:
            continue
        if needle in env and alive(pid) and not _spared(pid):
            found.append(pid)
    return found


def descendants(root: int) -> list[int]:
    """Live processes whose parent chain leads to `root`."""
    children: dict[int, list[int]] = {}
    for pid in _pids():
        stat = _stat(pid)
        if stat is not None:
            children.setdefault(stat[1], []).append(pid)
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return [p for p in found if alive(p) and not _spared(p)]


def kill(pids: Iterable[int], timeout: float = 10.0) -> list[int]:
    """SIGKILL `pids` (waking stopped ones first), wait until they are gone, reap those that are
    our own children. Returns the ones still alive after `timeout` (none, unless uninterruptible)."""
    pids = list(pids)
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass  # not our child, or a Popen already waited for it
    return [p for p in pids if alive(p)]


def kill_group(pgid: int) -> None:
    """SIGKILL a process group, waking it first (a stopped process ignores everything else)."""
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def reap_marked(var: str, value: str, rounds: int = 5) -> list[int]:
    """Kill every process marked `var=value`; again while new ones appear (one may fork as we kill).
    Returns the pids it killed."""
    killed: list[int] = []
    for _ in range(rounds):
        pids = marked(var, value)
        if not pids:
            break
        kill(pids)
        killed += pids
    return killed


def reap_session(spare: Iterable[int] = ()) -> list[int]:
    """Kill everything this session started that is still alive: marked processes and descendants
    of this process, except `spare`. Returns the pids it killed."""
    spare = set(spare)
    pids = (set(marked(SESSION_VAR, session_token())) | set(descendants(os.getpid()))) - spare
    kill(pids)
    return sorted(pids)
