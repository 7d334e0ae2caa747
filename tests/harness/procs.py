"""Child processes for tests: started in their own session, marked, waited for with deadlines,
and killed with everything they started.

Every wait is bounded and polls something the process writes (its output, a file), so a test
waits for an event, never for a guessed duration.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.harness import reaping

REPO = Path(__file__).resolve().parents[2]  # children run here: `python -m tests...` and `-m diloco_p2p` resolve


def child_env(extra: dict[str, str] | None = None, token: str | None = None) -> dict[str, str]:
    """The environment of a test's child: unbuffered, one thread, marked for reaping."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(extra or {}))
    env[reaping.SESSION_VAR] = reaping.session_token()
    if token is not None:
        env[reaping.PROC_VAR] = token
    return env


def diloco(*args: str) -> list[str]:
    """The interpreter arguments of `python -m diloco_p2p ARGS`."""
    return ["-m", "diloco_p2p", *args]


def faulty_train(*args: str) -> list[str]:
    """The interpreter arguments of `python -m diloco_p2p train ARGS` with the fault tests' injection
    (`tests.faults.node`: the faults and start gate that its environment plans)."""
    return ["-m", "tests.faults.node", "train", *args]


class Proc:
    """`python ARGV...` in its own session. Its output (stdout and stderr) goes to `log_path` and
    is kept in memory with the time each line arrived. `stdin=subprocess.PIPE` gives it a pipe
    (`popen.stdin`) to hold open; by default it shares the test's."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None,
                 prefix: Sequence[str] = (), name: str | None = None, stdin: int | None = None):
        self.argv, self.log_path, self.name = argv, log_path, name or log_path.stem
        self.token = reaping.new_token()
        self.lines: list[tuple[float, str]] = []
        self.ended: float | None = None  # when a wait saw it exit
        self._log = open(log_path, "w")
        self.popen = subprocess.Popen([*prefix, sys.executable, *argv], stdin=stdin, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, errors="replace", cwd=REPO,
                                      env=child_env(env, self.token), start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append((time.monotonic(), line))
            self._log.write(line)
            self._log.flush()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    def tail(self, lines: int = 30) -> str:
        return "".join(line for _, line in self.lines[-lines:])

    def first(self, needle: str) -> float | None:
        """When the first line holding `needle` arrived."""
        return next((t for t, line in self.lines if needle in line), None)

    def signal(self, sig: int) -> None:
        """Signal the process itself (not its p2pd children: a real crash leaves them to die)."""
        os.kill(self.popen.pid, sig)

    def exited(self) -> bool:
        """Whether it exited; its output is then read to the end (or as far as its survivors let)."""
        if self.popen.poll() is None:
            return False
        self.ended = self.ended or time.monotonic()
        self._drain()
        return True

    def _drain(self, idle: float = 1.0, limit: float = 10.0) -> None:
        """Read what the process wrote before it exited. The pipe ends when its last writer does;
        a DHT process or p2pd left behind by a SIGKILL may hold it open, so stop once it is quiet."""
        deadline = time.monotonic() + limit
        while self._reader.is_alive() and time.monotonic() < deadline:
            seen = len(self.lines)
            self._reader.join(timeout=idle)
            if len(self.lines) == seen:
                break

    def exit_code_within(self, timeout: float | None) -> int | None:
        """The exit code, or None if it is still running after `timeout` seconds."""
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        self.exited()
        return self.popen.returncode

    def watch(self) -> Proc:
        """Note when it exits (`ended`) even if nobody waits for it then: a thread waits. For a
        process started ahead of the test that asserts how soon it stopped."""
        threading.Thread(target=self.exit_code_within, args=(None,), daemon=True).start()
        return self

    def wait(self, timeout: float) -> int:
        rc = self.exit_code_within(timeout)
        if rc is None:
            raise AssertionError(f"{self.name} still running after {timeout:g} s:\n{self.tail()}")
        return rc

    def kill(self) -> None:
        """Kill its process group, then whatever it started elsewhere (marked with its token)."""
        if self.popen.poll() is None:
            reaping.kill_group(self.popen.pid)  # the leader is not reaped yet: its group id is still ours
        self.popen.wait()
        if self.popen.stdin is not None:
            self.popen.stdin.close()
        reaping.reap_marked(reaping.PROC_VAR, self.token)
        self._drain()
        self._log.close()


class Procs:
    """The processes a test or a fixture started; `close` kills them all."""

    def __init__(self) -> None:
        self._procs: list[Proc] = []

    def start(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None,
              prefix: Sequence[str] = (), name: str | None = None, stdin: int | None = None) -> Proc:
        return self.add(Proc(argv, log_path, env, prefix, name, stdin))

    def add(self, proc: Proc) -> Proc:
        self._procs.append(proc)
        return proc

    def __iter__(self) -> Iterator[Proc]:
        return iter(list(self._procs))

    def close(self) -> None:
        for p in self._procs:
            p.kill()

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_cli(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    """`python -m diloco_p2p ARGS` to completion; whatever it leaves running is killed."""
    token = reaping.new_token()
    popen = subprocess.Popen([sys.executable, *diloco(*args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=REPO, env=child_env(None, token), start_new_session=True)
    try:
        out, err = popen.communicate(timeout=timeout)
    finally:
        if popen.poll() is None:
            reaping.kill_group(popen.pid)
            popen.communicate()
        reaping.reap_marked(reaping.PROC_VAR, token)
    return subprocess.CompletedProcess(popen.args, popen.returncode, out, err)


def run_clis(*commands: list[str], timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """`run_cli` of each of `commands`, all at once: independent one-shot commands (bad input
    that must fail in one line) then cost one interpreter start of wall time, not one each."""
    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda args: run_cli(args, timeout), commands))


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, *procs: Proc) -> None:
    """Poll `predicate` until it holds; fail after `timeout` s, or at once if one of `procs`
    exited while it does not hold (after reading that process's last output)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        dead = [p for p in procs if p.exited()]
        if dead and predicate():
            return
        for p in dead:
            raise AssertionError(f"{p.name} exited ({p.popen.returncode}) while waiting for {what}:\n{p.tail()}")
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.log_path}\n{p.tail()}" for p in procs)
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}\n{tails}")
        time.sleep(0.1)


def read_records(run_dir: Path) -> list[dict]:
    """The round records of a run directory's metrics.jsonl (a line still being written is left out)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]
