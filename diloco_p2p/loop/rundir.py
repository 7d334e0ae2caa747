"""A node's run directory: created and checked once, before anything is written into it.

Everything a node keeps between runs lives there (config, identity, node key, checkpoints,
``metrics.jsonl``), so a directory the node cannot write is found at start, with one line that
names it, not as a traceback in the middle of the first round.
"""

from __future__ import annotations

import secrets
import tempfile
from pathlib import Path

from diloco_p2p.errors import UserError


def prepare_run_dir(path: Path | str) -> Path:
    """Create `path` if missing and check that this user can write in it; `UserError` naming the
    directory when it cannot be created or written."""
    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as e:
        raise UserError(
            f"run directory {path} is not writable ({e.strerror or e}); choose a writable --run-dir "
            "or fix its permissions"
        ) from None
    return path


def node_key(run_dir: Path) -> str:
    """A random key created once per run directory; fixes a solo node's data order across resumes."""
    path = run_dir / "node_key"
    if not path.exists():
        path.write_text(secrets.token_hex(16))
    return path.read_text().strip()
