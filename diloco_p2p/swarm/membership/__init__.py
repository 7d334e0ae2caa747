"""Who averages with whom, and what the swarm's progress records say.

Forming a round's group (`matchmaking`, its pure rules in `grouping`, who it waits for in
`liveness`), the signed progress records each node publishes (`records`) and the resync policy
read from them (`resync`). The protocols: docs/protocol/matchmaking.md, docs/protocol/records.md.
"""
