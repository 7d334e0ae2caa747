"""The run directory: created when missing, refused with one line when it cannot be written."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from diloco_p2p.errors import UserError
from diloco_p2p.loop.rundir import node_key, prepare_run_dir

# Prints, for each directory argument, "ok" or the UserError's line.
CHECK = """
import sys
from diloco_p2p.errors import UserError
from diloco_p2p.loop.rundir import prepare_run_dir
for path in sys.argv[1:]:
    try:
        prepare_run_dir(path)
        print("ok")
    except UserError as e:
        print(e)
"""


def test_a_missing_run_dir_is_created_with_its_parents(tmp_path):
    path = prepare_run_dir(str(tmp_path / "runs" / "a"))
    assert path == tmp_path / "runs" / "a" and path.is_dir()
    assert list(path.iterdir()) == []  # the write check leaves nothing behind
    assert prepare_run_dir(path) == path  # an existing, writable one is fine


def test_a_file_in_the_way_is_one_line(tmp_path):
    (tmp_path / "runs").write_text("not a directory")
    with pytest.raises(UserError) as e:
        prepare_run_dir(tmp_path / "runs" / "a")
    assert str(e.value).startswith(f"run directory {tmp_path / 'runs' / 'a'} is not writable (")
    assert "choose a writable --run-dir" in str(e.value) and e.value.exit_code == 2


def test_a_read_only_run_dir_is_one_line_naming_it(tmp_path):
    """Root writes through permission bits, so for root the directory is a read-only mount."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:
        prefix = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o ro tmpfs "$0" && exec "$@"', str(ro)]
    else:
        ro.chmod(0o555)
        prefix = []
    out = subprocess.run([*prefix, sys.executable, "-c", CHECK, str(ro), str(ro / "run")],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0 and prefix:
        pytest.skip(f"cannot mount a read-only directory here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    existing, missing = out.stdout.splitlines()
    assert existing.startswith(f"run directory {ro} is not writable (") and "--run-dir" in existing
    assert missing.startswith(f"run directory {ro / 'run'} is not writable (")
    assert "Read-only file system" in existing + missing or "Permission denied" in existing + missing


def test_node_key_is_created_once(tmp_path):
    key = node_key(tmp_path)
    assert len(key) == 32 and node_key(tmp_path) == key
