"""State sharing ("checkpoints through the DHT"): donors announce the state they can serve,
joiners stream it from one of them and verify it before using it.

Modules: `codec` (the blob), `announcements` (the DHT record and the order joiners try donors
in), `server` (the donor, `StateServer`), `client` (the joiner, `fetch_state`); and `datashare`,
the corpus's shards served and fetched the same way (its own docstring).

The state is an opaque blob to the protocol. A node builds it with `pack_state` (safetensors
bytes of the global fp32 parameters θ, the outer momentum and, optionally, its inner optimizer
state, plus a small JSON metadata with the round) and reads it back with `unpack_state`; no
pickle on either side. Put only swarm-wide values in the metadata: safetensors output is
deterministic, so nodes that agree on θ and m at a round produce byte-identical blobs, announce
the same sha256, and a joiner can resume a transfer on another donor where the first stopped.
(A blob that carries a node's own inner optimizer state differs per donor; that still works,
only without cross-donor resume.)

Protocol:

- **Announce.** A `StateServer` stores ``{round, sha256, size, params_hash}`` under DHT key
  ``f"{run_id}.state"``, subkey = its peer id, with an expiration it refreshes in the
  background while it serves. A donor that dies without withdrawing stays listed until the
  expiration (60 s by default); joiners that try it fail fast and move on. Withdrawing stores a
  tombstone (``None``) that outlives the record, as hivemind cannot delete a value.
- **Fetch.** One libp2p stream per attempt (handler ``f"{run_id}.state.v1"``): the joiner sends
  a JSON request ``{sha256, offset}``; the donor answers with a JSON header (``ok`` and the
  size, or ``gone`` / ``busy`` / ``bad-request``), then the raw bytes from `offset`. Headers are
  JSON frames (`diloco_p2p.swarm.transport.streams`) read with an upper bound. After the
  last byte the joiner sends one byte of verdict (sha256 matched or not) and the donor one byte
  back, so both sides know the transfer is complete (`served_count` counts verified ones).
- **Choosing a donor.** hivemind's `DecentralizedAverager.load_state_from_peers` sorts donors by
  an announced priority (`hivemind.Optimizer` sets it to the local epoch), random only among
  equal priorities: every joiner goes to the peer with the highest number (one that is an epoch
  ahead, or that announces a bogus priority, gets them all), donors are tried one by one with
  no resume, and whatever arrives is used unchecked (no hash; a failure ends in `None`). Here a
  joiner orders the donors of the newest state by rendezvous hashing (highest random weight,
  Thaler & Ravishankar 1998): score = H(joiner ‖ donor). Every joiner gets its own uniformly
  random order without coordination, and when a donor leaves, only the joiners that ranked it
  first change their choice. A donor also caps its concurrent transfers (`max_concurrent`);
  past it, it answers ``busy`` and the joiner tries the next one, so a burst of joiners
  spreads over the donors even when the hash sends two to the same one.
- **Failures.** A donor that cannot be reached, dies (the stream ends), stalls (no byte for
  `stall_timeout`), says it no longer holds that state, or serves bytes whose sha256 differs
  from its announcement is dropped for the rest of the fetch and the next one is tried,
  resuming from the bytes already received when it announces the same sha256. A verification
  failure on a blob assembled from several donors cannot be blamed on one of them, so that
  sha256 is then fetched again from a single donor. When the listing is exhausted the joiner
  lists again (donors may have moved to a newer round); the whole fetch is bounded by
  `timeout`, and ends in `StateUnavailable` whose one-line message says what was tried and why
  each attempt failed.

A donor may announce a state it made up, with a matching sha256: the blob's hash only proves
that the donor sent what it announced. So a node resyncs to a (round, θ hash) that the swarm's
signed progress records vouch for (`diloco_p2p.swarm.membership.resync`), tries only donors announcing
that state or a later one the records vouch for by then (`fetch_state(accept=...)`), and checks
what it received (`verify=codec.StateCheck`, which hashes the θ): a donor whose blob holds
another θ or round than it announced is refused and named (`FetchedState.forged`), and the
next one tried. Without a
`params_hash` (a plain `diloco-p2p fetch`), a joiner prefers the θ hash most donors announce.
Donors announce under a signed subkey (`diloco_p2p.swarm.trust.signing`): nobody announces, or
withdraws, in another donor's name. In a closed run the donor serves admitted peers only.

Costs: the blob lives in memory on both sides (the joiner briefly holds it twice when it hands
it over), fine for the small and 150M presets; a 1B state (θ and m in fp32, 8 GB) would want a
donor serving from its checkpoint file and a joiner writing to disk. Measured on loopback
(two p2pd daemons on a loaded 2-core box, noise-encrypted yamux streams): ~40 MB/s for 4 MB
(dominated by the DHT lookup), 100-200 MB/s for 16-256 MB.
"""

