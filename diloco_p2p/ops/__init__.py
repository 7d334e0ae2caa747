"""What an operator runs beside the nodes: the DHT `seed`, the swarm's `status`, checkpoint
and dataset `transfer` (export, fetch), and the local `demo`."""
