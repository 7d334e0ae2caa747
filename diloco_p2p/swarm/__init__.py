"""The swarm: everything a node does with its peers, below the round contract (`diloco_p2p.contract`).

`sync` (`SwarmSync`, one endpoint) and `shards` (an N-rank node's endpoints) are the facade the
node uses; below them, each sub-package one concept, each importing only from those under it
(`tests/unit/test_layout.py` checks it):

- `collective`, `membership`, `state`: side by side, none imports another. The all-reduce and
  all-gather with their grid, aggregation, codecs and wire formats; forming a round's group,
  progress records and the resync policy; sharing state and the corpus's shards.
- `transport`: the DHT, the background event loop, reachability, stream framing.
- `trust`: signed records, validators, admission to a closed run, the guard that counts refusals.
"""
