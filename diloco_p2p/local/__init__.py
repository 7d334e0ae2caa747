"""The ranks of one node: several local GPUs training one replica with FSDP2.

`ranks` holds the node-wide collectives among local ranks, `fsdp` shards the model and maps
state between the 1-rank and N-rank layouts, `launch` starts the ranks, `threads` shares the
CPU among them. Below the swarm and the loop: both read a node's ranks.
"""
