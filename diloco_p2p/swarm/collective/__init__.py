"""Averaging one group's pseudo-gradients, so that every member ends with the same bits.

The butterfly all-reduce (`allreduce`, its commit rule in `allreduce_state`), the sparse
all-gather (`allgather`), the grid of sub-groups past the target group size (`hierarchy`),
robust aggregation and reducer checks (`aggregate`), the bytes on the wire (`wire`, `codecs`),
and how a round's averaging ended (`outcome`). The protocols: docs/protocol/allreduce.md.
"""
