"""State sharing: checkpoints through the DHT, streamed from several donors and verified.

Donors announce the state they serve under a signed subkey; a joiner orders them by rendezvous
hashing, streams the blob in verified stripes from several at once, and uses only a state the
swarm's signed records vouch for; a donor that dies, stalls or lies loses its stripes and is
named. `codec`: the blob (safetensors and JSON, no pickle); `announcements`: the DHT record and
the donors' order; `server`: the donor; `client`: the joiner; `stripes`: one blob from several
donors. The corpus's shards travel the same way (`diloco_p2p.swarm.datashare`).
The protocol: docs/protocol/state-transfer.md
"""
