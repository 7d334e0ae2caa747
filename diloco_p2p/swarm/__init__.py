"""The swarm: everything a node does with its peers, below the round contract.

`sync` (`SwarmSync`, one endpoint), `multirank` (an N-rank node's endpoints) and `datashare`
(the corpus's shards) sit at the top, the facade the node uses (`diloco_p2p.contract` is the
seam); below them each sub-package holds one concept and imports only from those under it
(`tests/unit/test_layout.py` checks it):

- `collective`, `membership`, `state`: side by side, none imports another. The all-reduce and
  all-gather with their grid, aggregation, codecs and wire formats; forming a round's group,
  progress records and the resync policy; sharing state.
- `transport`: the DHT, the background event loop, reachability, stream framing.
- `trust`: signed records, validators, admission to a closed run, the guard that counts refusals.
"""
