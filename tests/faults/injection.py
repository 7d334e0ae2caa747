"""Deterministic fault injection for the fault tests: real signals at named points of a round.

A node started as ``python -m tests.faults.node train ARGS`` (`tests.faults.node`) reads these
variables once at start and installs `PlannedFaults` at the product's hook points
(`diloco_p2p.faults`); the product itself reads none of them.

``DILOCO_P2P_FAULTS`` is a comma-separated list of ``ACTION@POINT:ROUND`` items, e.g.
``kill@allreduce:2`` (SIGKILL itself when its round-2 all-reduce has sent its parts) or
``nan@delta:2`` (send a NaN pseudo-gradient in round 2).
Actions: ``kill`` (SIGKILL), ``stop`` (SIGSTOP: the process freezes with its sockets open, as
a stalled machine would; the test sends SIGCONT), ``hold`` (block the training loop there
for good while the process stays reachable: its metrics endpoint, DHT records and state server
keep answering, so a test reads a node parked at a known round), ``nan`` (poison the
pseudo-gradient), ``exit`` (raise SystemExit, for a local rank dying inside a multi-rank node),
``keep`` (no fault: keep each round's Δ and the average applied, so a test can recompute the
mean itself; ``keep@average`` with no round means every round, saved as safetensors under
``<run dir>/deltas/``).
Lies of a hostile member (issue 12), each for one round: ``flip@delta`` (send -Δ with a token weight
of 0.999 × ``sync.max_weight_ratio`` × its own: the largest the bound lets through),
``scale@delta`` (send Δ × 1000: a huge norm, finite in fp16), ``scale@reduce`` (as a reducer,
send its averaged part × 1000 to every member), ``shrink@reduce`` (× 0.001), ``nudge@reduce`` (× 0.8) and ``split@reduce`` (as a reducer, send each
member its own altered copy of its part); the reducer lies reduce with `tests.faults.lying`.
Points: ``delta`` (the round's pseudo-gradient is computed, before matchmaking), ``moments`` (the
inner first moments handed to ``sync.average_moments``' all-reduce: ``nan``, ``flip``, ``scale``), ``group`` (a
group formed), ``allreduce`` (our parts are sent), ``reduce`` (we reduce our part), and in a
multi-rank node ``rankR.step`` (local rank R is about to take inner step N, the number after
the colon). Each item fires at most once. A misspelt item is an error at start, not a fault that
silently never fires.

``DILOCO_P2P_START_GATE=PATH`` is the tests' start barrier (`PlannedFaults.start_gate`): once a
node has joined the swarm it writes ``PATH.ready-<pid>`` and waits for ``PATH`` to exist before
its first round, so a test starts several nodes' rounds together instead of hoping they start
within a timeout.

``DILOCO_P2P_CORRUPT_SHARDS=1``: the node serves every data shard with its first byte flipped
(`flip_first_byte`, at `DataShare._outgoing`); in-process tests set the same hook on one
`DataShare` or `StateServer`.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from pathlib import Path

import torch

from diloco_p2p import faults
from diloco_p2p.swarm.datashare import DataShare
from tests.faults.lying import LyingAllreduce

log = logging.getLogger(__name__)
ENV = "DILOCO_P2P_FAULTS"
GATE_ENV = "DILOCO_P2P_START_GATE"
CORRUPT_SHARDS_ENV = "DILOCO_P2P_CORRUPT_SHARDS"
ACTIONS = ("kill", "stop", "hold", "nan", "exit", "keep", "flip", "scale", "shrink", "nudge", "split")
POINT = re.compile(r"delta|moments|group|allreduce|reduce|rank\d+\.step")
LIE_POINTS = {"nan": ("delta", "moments"), "flip": ("delta", "moments"), "scale": ("delta", "moments", "reduce"),
              "shrink": ("reduce",),
              "nudge": ("reduce",), "split": ("reduce",)}
SCALE = 1000.0  # scale@delta's factor
EVERY_ROUND = -1


def install_from_env() -> None:
    """What `tests.faults.node` does before the command runs: plan this process's faults from the
    environment (a bad plan raises here, at start) and install them."""
    planned = PlannedFaults()
    faults.install(lambda: planned)
    if os.environ.get(CORRUPT_SHARDS_ENV) == "1":
        DataShare._outgoing = staticmethod(flip_first_byte)  # the node builds its DataShare itself


def flip_first_byte(chunk: bytes | memoryview) -> bytes:
    """A served chunk with its first byte flipped: the donor's copy no longer matches its hash."""
    return bytes([chunk[0] ^ 0xFF]) + bytes(chunk[1:])


def wait_at_start_gate(timeout: float = 300.0) -> None:
    """Test barrier (see the module docstring); returns at once unless the variable is set."""
    gate = os.environ.get(GATE_ENV)
    if not gate:
        return
    gate_path = Path(gate)
    Path(f"{gate}.ready-{os.getpid()}").touch()
    deadline = time.monotonic() + timeout
    while not gate_path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{GATE_ENV}: {gate} did not appear within {timeout:g} s")
        time.sleep(0.05)


class PlannedFaults(faults.Faults):
    """The faults a spec plans (see the module docstring), at the product's hook points."""

    lying_reducer: type = LyingAllreduce  # the all-reduce class a planned reducer lie uses

    def __init__(self, spec: str | None = None):
        spec = os.environ.get(ENV, "") if spec is None else spec
        self.pending: set[tuple[str, str, int]] = set()
        for item in filter(None, (s.strip() for s in spec.split(","))):
            action, _, rest = item.partition("@")
            point, _, round_ = rest.partition(":")
            if item == "keep@average":
                self.pending.add(("keep", "average", EVERY_ROUND))
                continue
            if action not in ACTIONS or not POINT.fullmatch(point) or not round_.isdigit():
                raise ValueError(f"{ENV}: bad item {item!r}; expected ACTION@POINT:ROUND with ACTION one of "
                                 f"{', '.join(ACTIONS)} and POINT delta, moments, group, allreduce, reduce or rankR.step, "
                                 "e.g. kill@allreduce:2 (or keep@average)")
            if action == "keep":
                raise ValueError(f"{ENV}: bad item {item!r}; keep takes no point or round of its own: keep@average")
            if action in LIE_POINTS and point not in LIE_POINTS[action]:
                raise ValueError(f"{ENV}: bad item {item!r}; {action} lies at {' or '.join(LIE_POINTS[action])}")
            if action not in LIE_POINTS and point == "reduce":
                raise ValueError(f"{ENV}: bad item {item!r}; reduce is a point of the lies scale, shrink, nudge and split")
            self.pending.add((action, point, int(round_)))

    def start_gate(self) -> None:
        """The tests' start barrier, once the node has joined (see the module docstring)."""
        wait_at_start_gate()

    def keep(self, directory: Path, round_: int, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        """With ``keep@average``: save this round's tensors under `directory`/deltas."""
        if ("keep", "average", EVERY_ROUND) not in self.pending:
            return
        from safetensors.torch import save_file

        (directory / "deltas").mkdir(parents=True, exist_ok=True)
        save_file({k: t.contiguous() for k, t in tensors.items()},
                  str(directory / "deltas" / f"round-{round_:06d}.safetensors"), metadata=meta)

    def _take(self, point: str, round_: int, actions: tuple[str, ...]) -> str | None:
        for action in actions:
            if (action, point, round_) in self.pending:
                self.pending.discard((action, point, round_))
                return action
        return None

    def fire(self, point: str, round_: int) -> None:
        """Deliver a process-level fault planned for this point and round, if any."""
        action = self._take(point, round_, ("kill", "stop", "hold", "exit"))
        if action is None:
            return
        log.warning("fault injection: %s at %s of round %d", action, point, round_)
        for handler in logging.getLogger().handlers:
            handler.flush()
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif action == "hold":
            while True:  # until the test kills us; other threads (metrics, DHT, state) go on
                time.sleep(60)
        else:
            raise SystemExit(3)

    def poison(self, point: str, round_: int, tensor: torch.Tensor) -> torch.Tensor:
        """A NaN-filled copy of `tensor` if a `nan` fault is planned here, else `tensor`."""
        if self._take(point, round_, ("nan",)) is None:
            return tensor
        log.warning("fault injection: NaN %s in round %d", point, round_)
        poisoned = tensor.clone()
        poisoned[::7] = float("nan")
        return poisoned

    @property
    def lies_as_reducer(self) -> bool:
        """Whether a reducer lie is planned (the node then reduces with `lying_reducer`)."""
        return any(point == "reduce" for _, point, _ in self.pending)

    def reducer(self, honest: type) -> type:
        """The all-reduce class the node reduces with: `lying_reducer` when a reducer lie is planned."""
        return self.lying_reducer if self.lies_as_reducer else honest

    def arm_reducer(self, service: object, round_: int) -> None:
        """Before a round's averaging: give a lying reducer this round's lie (`reducer_lie`)."""
        if isinstance(service, self.lying_reducer):
            service.lie = self.reducer_lie(round_)

    def lie(self, round_: int, delta: torch.Tensor, weight: float, max_weight_ratio: float,
            point: str = "delta") -> tuple[torch.Tensor, float]:
        """The contribution a ``flip@POINT`` or ``scale@POINT`` planned for this round sends instead."""
        action = self._take(point, round_, ("flip", "scale"))
        if action is None:
            return delta, weight
        log.warning("fault injection: %s %s in round %d", action, point, round_)
        if action == "flip":
            return -delta, 0.999 * max_weight_ratio * weight
        return delta * SCALE, weight

    def reducer_lie(self, round_: int) -> str | None:
        """`LyingAllreduce.lie` for this round: ``scale-output`` / ``shrink-output`` / ``nudge-output`` /
        ``split-output`` when planned."""
        action = self._take("reduce", round_, ("scale", "shrink", "nudge", "split"))
        if action is not None:
            log.warning("fault injection: %s at reduce of round %d", action, round_)
        return f"{action}-output" if action else None
