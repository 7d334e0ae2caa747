"""What our DHT records have in common: one key per run holding a dictionary (subkey = the
publisher's base58 peer id, value = a strict pydantic.v1 model, ``None`` = a tombstone).

Validation happens twice. Storing peers run hivemind's `SchemaValidator` (`subkey_validator`,
given to `start_dht(record_validators=...)`), which rejects values that need any type
conversion; and every reader parses each entry again (`live_values`), because the peers that
happen to hold a key (a seed, say) may not know our run id or may run another version.

The models are pydantic.v1 models (hivemind's schema machinery is built on v1), deliberately
separate from the v2 config models in `diloco_p2p.config`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

import pydantic.v1 as pydantic
from hivemind.dht.schema import SchemaValidator
from hivemind.utils import get_dht_time

PeerB58 = pydantic.constr(strict=True, regex=r"^[1-9A-HJ-NP-Za-km-z]{20,128}$")
Hex64 = pydantic.constr(strict=True, regex=r"^[0-9a-f]{64}$")
Count = pydantic.conint(strict=True, ge=0)


class _SchemaBase(pydantic.BaseModel):
    # Our own Config class: hivemind's SchemaValidator sets `schema.Config.extra`, and a model
    # without one would resolve that to pydantic.v1's global BaseConfig and change every model.
    class Config:
        extra = pydantic.Extra.forbid


def subkey_validator(name: str, key: str, value_model: type[pydantic.BaseModel]) -> SchemaValidator:
    """A hivemind validator for DHT key `key`: a dictionary from peer ids to `value_model`
    values or tombstones. The schema's field name is the raw key (hivemind hashes field names
    to match keys); other keys pass through untouched."""
    schema = pydantic.create_model(
        name, __base__=_SchemaBase, **{key: (Optional[dict[PeerB58, Optional[value_model]]], None)}
    )
    return SchemaValidator(schema, allow_extra_keys=True)


def live_values(found: Any, now: float | None = None) -> Iterator[tuple[Any, Any]]:
    """(subkey, value) of each entry in the result of `dht.get(key)` that is neither a tombstone
    nor expired at `now` (default: DHT time). The caller still parses every value."""
    entries = getattr(found, "value", None)
    if not isinstance(entries, dict):
        return
    now = get_dht_time() if now is None else now
    for subkey, item in entries.items():
        value, expiration = getattr(item, "value", None), getattr(item, "expiration_time", None)
        if value is not None and expiration is not None and expiration >= now:
            yield subkey, value
