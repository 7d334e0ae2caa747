"""The training loop of one node: H inner steps, then the outer step on the swarm's average.

`node.Node` drives a round; `inner` trains, `outer` holds θ and the outer momentum, `overlap`
runs the average beside the next round's steps, `fragments` syncs θ part by part,
`error_feedback` keeps what compression left out, `checkpoint` and `rundir` keep a node's
files, `metrics` exports what it did. It reaches the network only through `diloco_p2p.contract`.
"""
