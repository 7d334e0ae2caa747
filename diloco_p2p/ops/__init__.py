"""What an operator runs beside the nodes: the seed, status, transfers, the demo.

The DHT `seed`, the swarm's `status`, checkpoint and dataset `transfer` (export, fetch), and the
local `demo`.
"""
