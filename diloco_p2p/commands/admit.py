"""`diloco-p2p admit`: the run owner issues an admission token for a closed run.

The owner key is a private key file (created on first use, like a node identity); its public
half goes into every node's `sync.admission.owner_key`. The token admits one peer id (the
volunteer's, printed when its node starts: ``created a new identity ... (peer id ...)``) to one
run, until it expires; the volunteer points `sync.admission.token_path` at the file.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from diloco_p2p.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("admit", help="issue an admission token for a closed run (sync.admission)")
    p.add_argument("--owner-key", type=Path, required=True, help="the run owner's private key; created if missing")
    p.add_argument("--run-id", help="the run the token admits to")
    p.add_argument("--peer-id", help="the volunteer's peer id (base58)")
    p.add_argument("--valid-days", type=float, default=None, help="days until the token expires (default: never)")
    p.add_argument("--out", type=Path, help="write the token here (default: print it)")
    p.add_argument("--show-key", action="store_true", help="only print the owner's public key (sync.admission.owner_key)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from diloco_p2p.swarm.transport.dht import load_or_create_identity
    from diloco_p2p.swarm.trust.admission import issue_token
    from diloco_p2p.swarm.trust.signing import load_private_key, public_key_text

    owner = load_private_key(load_or_create_identity(args.owner_key))
    public = public_key_text(owner)
    if args.show_key:
        print(public)
        return 0
    if not args.run_id or not args.peer_id:
        raise UserError("admit needs --run-id and --peer-id (or --show-key to print the owner's public key)")
    if not re.fullmatch(r"[1-9A-HJ-NP-Za-km-z]{20,128}", args.peer_id) or not _decodes(args.peer_id):
        raise UserError(f"--peer-id {args.peer_id!r} is not a base58 peer id (e.g. QmY7amjHX8su...); copy the one "
                        "the volunteer's node printed")
    if args.valid_days is not None and not args.valid_days > 0:
        raise UserError(f"--valid-days must be a positive number of days, not {args.valid_days!r}")
    expires = None if args.valid_days is None else time.time() + args.valid_days * 86400
    token = issue_token(owner, args.run_id, args.peer_id, expires)
    if args.out is None:
        print(token)
    else:
        try:
            args.out.write_text(token + "\n")
        except OSError as e:
            raise UserError(f"--out {args.out}: cannot write ({e.strerror or e}); choose a writable path") from None
    print(f"owner key (sync.admission.owner_key): {public}", file=sys.stderr)
    return 0


def _decodes(peer_id: str) -> bool:
    from hivemind.p2p import PeerID

    try:
        return PeerID.from_base58(peer_id).to_base58() == peer_id
    except Exception:
        return False
