"""The loop trains bit for bit as it did: the per-round θ hashes (and losses, and the checkpoint
of a stopped run) of tiny runs in every overlap mode and with sync.fragments, recomputed against
``tests/unit/data/simulate_hashes.json``, which `tests.unit.simulate_hashes` wrote before the loop's
overlap modes became objects. Float arithmetic differs between CPU kinds and torch builds, so on
another kind than the file's the test skips, naming the command that rewrites the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.unit import simulate_hashes

GOLDEN = json.loads((Path(__file__).parent / "data" / "simulate_hashes.json").read_text())
REGENERATE = "python -m tests.unit.simulate_hashes > tests/unit/data/simulate_hashes.json"


@pytest.fixture(autouse=True)
def _same_arithmetic():
    here = {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability()}
    if here != {k: GOLDEN[k] for k in here}:
        pytest.skip(f"hashes recorded on {GOLDEN['cpu']} with torch {GOLDEN['torch']}, this is {here}; "
                    f"to check a change of the loop here, write them before it with `{REGENERATE}`")


def test_every_case_is_recorded():
    assert set(GOLDEN["replicas"]) == set(simulate_hashes.REPLICAS)
    assert set(GOLDEN["resumed"]) == set(simulate_hashes.RESUMED)


@pytest.mark.parametrize("name", sorted(simulate_hashes.REPLICAS))
def test_replicas_end_every_round_with_the_recorded_theta(tmp_path, name):
    assert simulate_hashes.replicas(simulate_hashes.REPLICAS[name], tmp_path) == GOLDEN["replicas"][name]


@pytest.mark.parametrize("name", sorted(simulate_hashes.RESUMED))
def test_a_stopped_and_resumed_node_checkpoints_and_trains_as_recorded(tmp_path, name):
    settings, stop_after = simulate_hashes.RESUMED[name]
    assert simulate_hashes.resumed(settings, stop_after, tmp_path) == GOLDEN["resumed"][name]
