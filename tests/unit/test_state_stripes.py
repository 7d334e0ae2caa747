"""Pure parts of striped state transfers: the layout a donor describes, the header bounds a
joiner checks before reading the digest list, the in-order whole-blob hash and which layout
wins among donors."""

from __future__ import annotations

import asyncio
import hashlib

from diloco_p2p.swarm.state.client import _most_common_layout
from diloco_p2p.swarm.state.stripes import (
    MAX_STRIPES,
    Assembly,
    DonorStream,
    Layout,
    check_header,
    stripe_count,
    stripe_digests,
)

BLOB = bytes(range(256)) * 41  # 10496 bytes: 10 stripes of 1 KiB and one of 256


def test_layout_covers_the_blob_in_stripes_with_their_digests():
    digests = stripe_digests(BLOB, 1024)
    layout = Layout(len(BLOB), 1024, digests)
    assert stripe_count(len(BLOB), 1024) == layout.count == 11 and len(digests) == 11 * 32
    assert [layout.bounds(i) for i in (0, 9, 10)] == [(0, 1024), (9216, 10240), (10240, 10496)]
    assert all(layout.digest(i) == hashlib.sha256(BLOB[slice(*layout.bounds(i))]).digest() for i in range(11))
    assert stripe_digests(b"", 1024) == b"" and stripe_count(0, 1024) == 0


def test_header_is_checked_before_the_digest_list_is_read():
    ok = {"ok": True, "size": len(BLOB), "stripe_size": 1024, "stripes": 11}
    assert check_header(ok, len(BLOB)) == (1024, 11)
    assert "announced" in check_header({**ok, "size": 5}, len(BLOB))
    assert "bad stripe header" in check_header({**ok, "stripes": 12}, len(BLOB))  # not the size's count
    assert "bad stripe header" in check_header({**ok, "stripe_size": 0}, len(BLOB))
    assert "bad stripe header" in check_header({**ok, "stripe_size": True}, len(BLOB))
    # a tiny stripe size would make the joiner read a huge digest list: refused first
    huge = 1 << 40
    assert "at most" in check_header({"size": huge, "stripe_size": 1, "stripes": huge}, huge)
    assert check_header({"size": MAX_STRIPES, "stripe_size": 1, "stripes": MAX_STRIPES}, MAX_STRIPES) == (
        1, MAX_STRIPES)


def test_whole_blob_hash_follows_stripes_landing_out_of_order_and_resumes():
    layout = Layout(len(BLOB), 1024, stripe_digests(BLOB, 1024))
    part = Assembly("x", layout)

    async def land(order, stop_after):
        landed, stopped = asyncio.Event(), False
        hashing = asyncio.ensure_future(part.hash_in_order(landed, lambda: stopped))
        for i in order:
            a, b = layout.bounds(i)
            part.buf[a:b] = BLOB[a:b]
            part.source[i] = "donor"
            landed.set()
            await asyncio.sleep(0)
        stopped = stop_after
        landed.set()
        await hashing

    asyncio.run(land([3, 1, 0, 2, 7], stop_after=True))  # a pass that ends early: 0-3 hashed
    assert part.hashed == 4 and part.missing() == [4, 5, 6, 8, 9, 10]
    asyncio.run(land([10, 9, 8, 6, 5, 4], stop_after=False))  # the next pass completes it
    assert part.hashed == 11 and part.hasher.hexdigest() == hashlib.sha256(BLOB).hexdigest()
    assert part.by_donor() == {"donor": len(BLOB)}


def test_the_layout_most_donors_sent_wins_ties_to_the_first():
    a, b = Layout(10, 5, b"a" * 64), Layout(10, 5, b"b" * 64)

    def donors(*layouts):
        return [DonorStream(None, None, None, layout) for layout in layouts]

    assert _most_common_layout(donors(a, b, b)) == b
    assert _most_common_layout(donors(b, a)) == b and _most_common_layout(donors(a, b)) == a
