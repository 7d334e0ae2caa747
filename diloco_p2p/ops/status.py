"""`diloco-p2p status`: what the swarm is doing, read from the progress records in the DHT.

It joins the DHT as a client (it serves and stores nothing), reads the run's progress records and
prints one row per node: its round, θ hash (agreeing with the majority at its round, or not),
MISSED and AWAY (what the others saw of it), REACH (public or behind NAT). Below the table: the
peers the nodes refuse and entries status found forged, peers reported away without a record,
and a warning when too few nodes are public. ``--json`` gives the same rows.
What each column means: docs/architecture.md, "Logs and metrics".
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from hivemind.utils import get_dht_time

from diloco_p2p.config import P2PConfig
from diloco_p2p.errors import UserError
from diloco_p2p.logs import short_peer
from diloco_p2p.swarm.membership.records import ProgressRecord, read_progress
from diloco_p2p.swarm.membership.resync import majority, round_majorities
from diloco_p2p.swarm.transport.dht import start_dht
from diloco_p2p.swarm.transport.reach import PRIVATE, shortage

# A client needs no reachable address; listening on loopback only exposes nothing.
CLIENT_HOST_MADDRS = ["/ip4/127.0.0.1/tcp/0"]
COLUMNS = ("PEER", "ROUND", "TOKENS/S", "TRAIN_LOSS", "EVAL_LOSS", "LAST_SEEN", "HASH_AGREES", "STATUS", "REACH",
           "MISSED", "AWAY")


def run_status(
    initial_peers: Sequence[str],
    run_id: str,
    as_json: bool = False,
    timeout: float = 20.0,
    *,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Print the swarm's nodes (a table, or a JSON list with `as_json`); returns the exit code:
    0, or 2 with one ``error: ...`` line on `err` when the DHT is unreachable or the run id
    has no records. `timeout` bounds joining and reading, each."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        rows = fetch_status(initial_peers, run_id, timeout)
    except UserError as e:
        print(f"error: {e}", file=err)
        return e.exit_code
    table = format_table(rows) + format_away(rows) + format_excluded(rows) + format_warning(rows)
    print(json.dumps(rows, indent=2) if as_json else table, file=out)
    return 0


def fetch_status(initial_peers: Sequence[str], run_id: str, timeout: float = 20.0) -> list[dict[str, Any]]:
    """The rows `run_status` prints (most advanced first); raises `UserError`."""
    if not initial_peers:
        raise UserError("status needs --initial-peers: the multiaddr of a seed or of any node of the run")
    if not timeout > 0:
        raise UserError(f"--timeout must be a positive number of seconds, not {timeout!r}")
    cfg = P2PConfig(
        initial_peers=list(initial_peers), host_maddrs=CLIENT_HOST_MADDRS, connect_timeout=timeout
    )
    dht = start_dht(cfg, None, client_mode=True)
    forged: dict[str, str] = {}
    try:
        try:
            records = read_progress(dht, run_id, timeout=timeout,
                                    on_reject=lambda peer, reason, detail: forged.setdefault(peer, reason))
        except TimeoutError:
            raise UserError(
                f"the DHT did not answer within {timeout:g} s; try again or raise --timeout"
            ) from None
    finally:
        dht.shutdown()
    if not records:
        raise UserError(
            f"no progress records for run id {run_id!r} in the DHT reached through {', '.join(initial_peers)}; "
            "check --run-id (nodes publish a record when they join and after every round)"
        )
    return status_rows(records, now=get_dht_time(), seen_forged=forged)


def status_rows(
    records: dict[str, ProgressRecord], now: float, seen_forged: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """One JSON-ready dict per node, most advanced round first, then by peer id."""
    params_majority = round_majorities(records)
    config_majority = majority(r.config_hash for r in records.values())
    rows = []
    for peer, r in sorted(records.items(), key=lambda kv: (-kv[1].round, kv[0])):
        rows.append(
            {
                "peer_id": peer,
                "peer": short_peer(peer),
                "round": r.round,
                "step": r.step,
                "tokens": r.tokens,
                "tokens_per_s": r.tokens_per_s,
                "train_loss": r.train_loss,
                "eval_loss": r.eval_loss,
                "last_seen_s": round(max(0.0, now - r.updated), 1),
                "params_sha256": r.params_sha256,
                "hash_agrees": r.params_sha256 == params_majority[r.round],
                "config_hash": r.config_hash,
                "config_agrees": r.config_hash == config_majority,
                "status": r.status,
                "group_size": r.group_size,
                "joined_at_round": r.joined_at_round,
                "resyncs": r.resyncs,
                "version": r.version,
                "excluded": dict(r.excluded or {}),
                "reachability": r.reachability or "public",
                **absence(records, peer),
            }
        )
    private = sum(r.reachability == PRIVATE for r in records.values())
    warning = shortage(len(records) - private, private)
    if warning and rows:
        rows[0]["swarm_warning"] = warning
    gone = {peer: absence(records, peer) for r in records.values() for peer in (r.away or {}) if peer not in records}
    if gone and rows:
        rows[0]["away_without_record"] = gone
    if seen_forged:  # status's own finding, in the first row so JSON stays a list of nodes
        rows[0]["status_saw_forged"] = dict(seen_forged)
    return rows


def absence(records: dict[str, ProgressRecord], peer: str) -> dict[str, Any]:
    """What the other nodes' records say of `peer`'s absences: the most rounds missed, the
    longest time away, and whether any of them is not waiting for it now."""
    seen = [r.away[peer] for p, r in records.items() if p != peer and r.away and peer in r.away]
    return {"missed_rounds": max((a.missed for a in seen), default=0),
            "away_s": max((a.away_s for a in seen), default=0.0), "away_now": any(a.away for a in seen)}


def format_away(rows: list[dict[str, Any]]) -> str:
    """The footer for peers reported away that have no record any more (empty when none)."""
    gone = rows[0].get("away_without_record") if rows else None
    if not gone:
        return ""
    lines = [f"  {short_peer(peer)}  missed {a['missed_rounds']} rounds, away {a['away_s']:.0f}s"
             f"{' (now)' if a['away_now'] else ''}" for peer, a in sorted(gone.items())]
    return "\n\nAWAY, NO RECORD\n" + "\n".join(lines)


def excluded_peers(rows: list[dict[str, Any]]) -> list[tuple[str, str, int]]:
    """(peer, reason, how many nodes exclude it) over the rows, most excluded first; a peer status
    itself saw forge a record counts as one more."""
    by: dict[tuple[str, str], int] = {}
    for row in rows:
        for peer, reason in {**row.get("excluded", {}), **row.get("status_saw_forged", {})}.items():
            by[peer, reason] = by.get((peer, reason), 0) + 1
    return sorted(((p, r, n) for (p, r), n in by.items()), key=lambda t: (-t[2], t[0], t[1]))


def format_excluded(rows: list[dict[str, Any]]) -> str:
    """The table's footer: one line per excluded peer (empty when nobody is)."""
    found = excluded_peers(rows)
    if not found:
        return ""
    lines = [f"  {peer}  {reason}  (by {n} node{'s' if n > 1 else ''})" for peer, reason, n in found]
    return "\n\nEXCLUDED PEERS\n" + "\n".join(lines)


def format_warning(rows: list[dict[str, Any]]) -> str:
    """The footer line for a swarm with too few public nodes (empty otherwise)."""
    warning = rows[0].get("swarm_warning") if rows else None
    return f"\n\nWARNING: {warning}" if warning else ""


def format_table(rows: list[dict[str, Any]]) -> str:
    cells = [COLUMNS] + [
        (
            row["peer"],
            str(row["round"]),
            f"{row['tokens_per_s']:.1f}",
            _loss(row["train_loss"]),
            _loss(row["eval_loss"]),
            f"{row['last_seen_s']:.0f}s",
            "yes" if row["hash_agrees"] else "no",
            row["status"],
            row.get("reachability", "public"),
            str(row.get("missed_rounds", 0)),
            f"{row.get('away_s', 0.0):.0f}s{' now' if row.get('away_now') else ''}" if row.get("missed_rounds") else "-",
        )
        for row in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in cells
    )


def _loss(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"
