"""What our DHT records have in common: one key per run, signed subkeys, strict values.

One key per run holds a dictionary (subkey = the publisher's peer id and the public key that
signs the entry, ``peer[owner:ssh-rsa ...]``, `signing`; value = a strict model; ``None`` = a
tombstone). Validation happens twice: storing peers run hivemind's `SchemaValidator`
(`subkey_validator`, given to `start_dht(record_validators=...)`), and every reader parses each
entry again (`live_values`), because the peers that hold a key may not know our run id or may
run another version. The models are pydantic.v1 (hivemind's schema machinery is built on v1),
separate from the v2 config models in `diloco_p2p.config`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Optional

import pydantic.v1 as pydantic
from hivemind.dht.schema import SchemaValidator
from hivemind.utils import get_dht_time

from diloco_p2p.swarm.trust.signing import OWNED_SUBKEY, owner_of

PeerB58 = pydantic.constr(strict=True, regex=r"^[1-9A-HJ-NP-Za-km-z]{20,128}$")
Hex64 = pydantic.constr(strict=True, regex=r"^[0-9a-f]{64}$")
Count = pydantic.conint(strict=True, ge=0)
# A signed entry's subkey: hivemind's RSASignatureValidator checks the signature by the key named
# here; readers check that the key is the peer id's (`signing.owner_of`). No owner part = unsigned.
OwnedSubkey = pydantic.constr(strict=True, regex=OWNED_SUBKEY.pattern)


class _SchemaBase(pydantic.BaseModel):
    # Our own Config class: hivemind's SchemaValidator sets `schema.Config.extra`, and a model
    # without one would resolve that to pydantic.v1's global BaseConfig and change every model.
    class Config:
        extra = pydantic.Extra.forbid


def subkey_validator(name: str, key: str, value_model: type[pydantic.BaseModel]) -> SchemaValidator:
    """A hivemind validator for DHT key `key`: a dictionary from owned subkeys (signed entries)
    to `value_model` values or tombstones. The schema's field name is the raw key (hivemind
    hashes field names to match keys); other keys pass through untouched."""
    schema = pydantic.create_model(
        name, __base__=_SchemaBase, **{key: (Optional[dict[OwnedSubkey, Optional[value_model]]], None)}
    )
    return SchemaValidator(schema, allow_extra_keys=True)


# Called with (peer, reason, detail) for each entry a reader refuses: `diloco_p2p.swarm.trust.guard`.
OnReject = Callable[[str, str, str], None]


def live_values(
    found: Any, now: float | None = None, on_reject: OnReject | None = None
) -> Iterator[tuple[str, Any]]:
    """(peer id, value) of each signed entry in the result of `dht.get(key)` that is neither a
    tombstone nor expired at `now` (default: DHT time). An entry whose subkey claims a peer id
    that its signing key is not made of is refused (``forged-record``, naming the signer) and
    an unsigned one dropped. The caller still parses every value."""
    entries = getattr(found, "value", None)
    if not isinstance(entries, dict):
        return
    now = get_dht_time() if now is None else now
    for subkey, item in entries.items():
        value, expiration = getattr(item, "value", None), getattr(item, "expiration_time", None)
        if value is None or expiration is None or expiration < now:
            continue
        claimed, signer = owner_of(subkey)
        if claimed is None or signer is None:
            continue  # unsigned or malformed: only a storing peer without our validators keeps those
        if claimed != signer:
            if on_reject is not None:
                on_reject(signer, "forged-record", f"an entry signed by it claims to be {claimed}'s")
            continue
        yield claimed, value
