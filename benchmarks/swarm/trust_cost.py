"""What records nobody can forge cost (issue 12): signing and verifying DHT entries, a reader's
owner checks, admission tokens, and the bytes a signature adds. CPU only, no network: these are
the per-record costs that a node pays each time it publishes or reads the run's records.

Printed: median microseconds per operation over `--repeats` runs, and bytes per entry.

    python benchmarks/swarm/trust_cost.py [--records 9] [--repeats 200]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for tests.unit.dht_fixtures

from hivemind.dht.validation import CompositeValidator  # noqa: E402
from hivemind.p2p import P2P  # noqa: E402
from hivemind.utils.timed_storage import ValueWithExpiration  # noqa: E402

from diloco_p2p.config import Config  # noqa: E402
from diloco_p2p.swarm.membership.records import (  # noqa: E402
    ProgressRecord,
    parse_progress,
    progress_key,
    progress_validator,
)
from diloco_p2p.swarm.trust import signing  # noqa: E402
from diloco_p2p.swarm.trust.admission import issue_token, verify_token  # noqa: E402
from tests.unit.dht_fixtures import KEYS, NOW, PEERS, dht_record, subkey  # noqa: E402


def _median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=9, help="records in the run for the read benchmark (at most 9)")
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()

    cfg = Config(run_id="r")
    with tempfile.TemporaryDirectory() as d:
        identity = Path(d) / "id.key"
        P2P.generate_identity(str(identity))
        key = signing.load_private_key(identity)
        me = signing.peer_id_of_public_key(signing.public_key_text(key))
        validator = CompositeValidator([signing.signature_validator(identity), progress_validator("r")])
        unsigned_only = progress_validator("r")

    def record(peer: str) -> ProgressRecord:
        return ProgressRecord.build(peer_id=peer, round=3, step=30, tokens=3840, tokens_per_s=12.5,
                                    params_sha256="a" * 64, config_hash=cfg.swarm_hash(),
                                    config_view=cfg.swarm_view(), status="committed", updated=NOW)

    own = signing.owned_subkey(me, signing.public_key_text(key))
    entry = dht_record(progress_key("r"), own, record(me).dict())
    signed = dataclasses.replace(entry, value=validator.sign_value(entry))
    plain = dht_record(progress_key("r"), me, record(me).dict())
    rows = [
        ("sign one entry (publisher)", _median_us(lambda: validator.sign_value(entry), args.repeats)),
        ("verify one entry: signature + schema (storing peer, reader)",
         _median_us(lambda: validator.validate(signed), args.repeats)),
        ("schema alone, before issue 12", _median_us(lambda: unsigned_only.validate(plain), args.repeats)),
    ]
    n = min(args.records, len(PEERS))
    found = ValueWithExpiration({subkey(p): ValueWithExpiration(record(p).dict(), NOW + 60) for p in PEERS[:n]},
                                NOW + 60)
    signing.peer_id_of_public_key.cache_clear()
    t0 = time.perf_counter()
    parse_progress(found, now=NOW)
    rows.append((f"parse {n} records, owner checks uncached (first read)", (time.perf_counter() - t0) * 1e6))
    rows.append((f"parse {n} records, owner checks cached", _median_us(lambda: parse_progress(found, now=NOW),
                                                                       args.repeats)))
    owner_key = signing.public_key_text(KEYS[-1])
    token = issue_token(KEYS[-1], "r", PEERS[0])
    rows.append(("verify one admission token", _median_us(lambda: verify_token(token, owner_key, "r"), args.repeats)))

    width = max(len(r[0]) for r in rows)
    print(f"{'operation'.ljust(width)}  median µs")
    for name, us in rows:
        print(f"{name.ljust(width)}  {us:9.1f}")
    print()
    print(f"bytes per progress entry: unsigned {len(plain.subkey) + len(plain.value)}, "
          f"signed {len(signed.subkey) + len(signed.value)} (subkey with the public key + signature)")
    print(f"admission token: {len(token)} bytes")
    if n < args.records:
        print(f"(read benchmark capped at the {n} fixture identities)")


if __name__ == "__main__":
    main()
