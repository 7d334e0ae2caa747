"""The swarm: everything a node does with its peers, below the round contract.

At the top, the facade the node uses: `sync` (`SwarmSync`, one endpoint), `multirank` (an N-rank
node's endpoints), `vouching` (what the swarm vouches for) and `datashare` (the corpus's shards).
Below, one concept per sub-package, each importing only from those under it (`test_layout.py`):
`collective`, `membership`, `state` side by side (the all-reduce and its wire; groups, records
and the resync rule; sharing state), then `transport` (the DHT, the event loop, reachability,
stream framing), then `trust` (signed records, validators, admission, the guard).
"""
