"""`p2p`, `metrics` and `log`: this node's own endpoints and output; they may differ between nodes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from diloco_p2p.config.section import Section


class P2PConfig(Section):
    initial_peers: list[str] = Field(
        default_factory=list, description="Multiaddrs of DHT peers to join (e.g. a seed); empty = train solo."
    )
    host_maddrs: list[str] = Field(
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"], description="Multiaddrs this node listens on."
    )
    announce_maddrs: list[str] = Field(
        default_factory=list, description="Multiaddrs other peers should dial (public address behind NAT)."
    )
    identity_path: str | None = Field(
        None, description="Private key file fixing the peer id; unset = `<run-dir>/identity.key`."
    )
    connect_timeout: float = Field(
        20.0, gt=0, description="Seconds to wait for the initial peers before giving up with an error."
    )
    reachability: Literal["auto", "public", "private"] = Field(
        "auto", description="Whether other peers can dial this node: `auto` asks an initial peer to dial it back "
        "at start; `private` (behind NAT, nothing inbound) averages through public peers and reduces no part.",
    )


class MetricsConfig(Section):
    host: str = Field("127.0.0.1", description="Address the Prometheus endpoint binds to.")
    port: int = Field(
        0, ge=-1, lt=65536,
        description="Prometheus endpoint port (0 = off; -1 = any free port, written to `<run-dir>/metrics_port`).",
    )


class LogConfig(Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")
    json_format: bool = Field(False, description="One JSON object per log line, for log shippers.")
