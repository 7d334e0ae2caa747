"""Planning a run before starting it: price a round, recommend settings, simulate replicas.

`plan` prices a round (compute, bytes, links), `recommend` picks the settings for a swarm,
`simulate` runs M replicas in one process on the real loop and codecs to measure quality
without a network.
"""
