"""State sharing ("checkpoints through the DHT"): donors announce the state they can serve,
joiners stream it from several of them at once and verify it before using it.

Modules: `codec` (the blob), `announcements` (the DHT record and the order joiners try donors
in), `server` (the donor, `StateServer`), `client` (the joiner, `fetch_state`), `stripes` (one
blob from several donors at once); and `datashare`, the corpus's shards served and fetched the
same way (its own docstring).

The state is an opaque blob to the protocol. A node builds it with `pack_state` (safetensors
bytes of the global fp32 parameters θ, the outer momentum and, optionally, its inner optimizer
state, plus a small JSON metadata with the round) and reads it back with `unpack_state`; no
pickle on either side. Put only swarm-wide values in the metadata: safetensors output is
deterministic, so nodes that agree on θ and m at a round produce byte-identical blobs, announce
the same sha256, and a joiner streams different stripes of it from each of them. (A blob that
carries a node's own inner optimizer state differs per donor; that still works, from one donor
at a time.)

Protocol:

- **Announce.** A `StateServer` stores ``{round, sha256, size, params_hash}`` under DHT key
  ``f"{run_id}.state"``, subkey = its peer id, with an expiration it refreshes in the
  background while it serves. A donor that dies without withdrawing stays listed until the
  expiration (60 s by default); joiners that try it fail fast and move on. Withdrawing stores a
  tombstone (``None``) that outlives the record, as hivemind cannot delete a value.
- **Fetch** (protocol v2, handler ``f"{run_id}.state.v2"``). The joiner opens one libp2p stream
  to each of up to `max_donors` donors (`sync.state_donors`, default 4) announcing the same
  (round, sha256, size, θ hash) and sends a JSON request ``{sha256}``; each donor answers with a
  JSON header (``ok``, the size and its stripe size, or ``gone`` / ``busy`` / ``bad-request``)
  and a frame of the sha256 of every stripe (1 MiB by default). The joiner takes the stripe
  list most donors sent, preallocates the blob once and asks each donor for stripes by index
  (``{stripe: i}``, a few ahead on its stream) from one shared queue, so a faster donor serves
  more of them; each stripe is written in place and checked against its digest as it lands,
  and the whole blob is hashed in order meanwhile. At the end the joiner sends each donor
  ``{done: verdict}`` (the whole blob's sha256 matched or not) and the donor one byte back, so
  both sides know the transfer is complete (`served_count` counts verified ones). Headers are
  JSON frames (`diloco_p2p.swarm.transport.streams`) read with an upper bound; the digest list
  is bounded by the announced size. With one donor this is one stream serving every stripe.
- **Versions.** A donor also serves v1 (``.state.v1``: ``{sha256, offset}``, the whole blob from
  the offset, then the verdict), so joiners of older releases keep working. A donor of an
  older release has no v2 handler: the joiner names it in one line ("speaks no state protocol
  v2") and goes on without it.
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
  `stall_timeout`, 10 s), says it no longer holds that state or breaks the protocol is dropped
  for the rest of the fetch, and the stripes it had in flight go back to the queue for the
  other donors (those already verified are kept, also for a later pass with other donors). A
  donor whose stripe does not match the digest in its own header lied: it is named
  (`FetchedState.forged`, ``bad-state`` in `SwarmSync.fetch`), never asked again, and its
  stripes go to the others. A stripe list that does not make up the announced sha256 (every
  stripe matched it, the whole blob did not) is a lie of every donor that sent it, caught by
  the whole-blob check and named the same way; a donor whose list differed from the majority's
  is only set aside, and is the next pass's if the majority lied. When a pass ends without a
  blob the joiner lists again (donors may have moved to a newer round); the whole fetch is
  bounded by `timeout`, and ends in `StateUnavailable` whose one-line message says what was
  tried and why each attempt failed.

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

Costs: the blob lives in memory on both sides (the joiner preallocates it once and writes the
stripes in place; `unpack_state` copies it once more), fine for the small and 150M presets; a
1B state (θ and m in fp32, 8 GB) would want a donor serving from its checkpoint file and a
joiner writing to disk. Hashing costs the joiner two sha256 passes (stripes and whole blob),
both in threads beside the download. Throughput from 1, 2 and 4 donors, on shaped links and on
loopback beside the transport's ceiling: `benchmarks/swarm/join_stripes.py` (docs/benchmarks.md).
"""
