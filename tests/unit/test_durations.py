"""tests/durations.json orders the suite's files for xdist (tests/conftest.py): it must name the files
that exist, and every multi-process file, or a long file would start last and keep one worker waiting."""

import json
from pathlib import Path

from tests.conftest import DURATIONS, file_cost

ROOT = Path(__file__).resolve().parents[2]


def test_durations_name_every_swarm_test_file_and_no_other():
    measured = json.loads(DURATIONS.read_text())
    files = {str(p.relative_to(ROOT)) for p in ROOT.glob("tests/*/test_*.py")}
    assert set(measured) <= files, f"gone: {sorted(set(measured) - files)}; rerun with --write-durations"
    swarm_files = {f for f in files if f.startswith(("tests/integration/", "tests/faults/"))}
    assert swarm_files <= set(measured), f"unmeasured: {sorted(swarm_files - set(measured))}; rerun with --write-durations"


def test_the_longest_files_go_first_and_an_unmeasured_file_is_not_put_last():
    measured = {"tests/integration/test_a.py": 100.0, "tests/unit/test_b.py": 2.0}
    ordered = sorted(["tests/unit/test_b.py", "tests/unit/test_new.py", "tests/integration/test_new.py",
                      "tests/integration/test_a.py"], key=lambda f: -file_cost(f, measured))
    assert ordered == ["tests/integration/test_a.py", "tests/integration/test_new.py", "tests/unit/test_b.py",
                       "tests/unit/test_new.py"]
