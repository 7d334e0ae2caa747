"""Records nobody can forge: each DHT entry of ours is signed by the peer it is about.

A node's peer id is the multihash of its libp2p RSA key, which p2pd proves on every stream. We
sign our DHT entries with the same key through hivemind's `RSASignatureValidator`: an entry's
subkey names the key (`owned_subkey`), and the validator rejects any entry not signed by it,
over key, subkey, value and expiration. The validator does not know peer ids, so `owner_of`
checks that the key is the one the peer id is made of: an entry about peer P can only be written
by whoever holds P's key. Signed entries: docs/protocol/records.md
"""

from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path

import hivemind
import multihash
from cryptography.hazmat.primitives import serialization
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

OWNED_SUBKEY = re.compile(r"^([1-9A-HJ-NP-Za-km-z]{20,128})\[owner:(ssh-rsa [A-Za-z0-9+/=]{100,1400})\]$")


def load_private_key(identity_path: Path | str) -> RSAPrivateKey:
    """The RSA key of a libp2p identity file (as `P2P.generate_identity` writes it)."""
    data = crypto_pb2.PrivateKey.FromString(Path(identity_path).read_bytes())
    if data.key_type != crypto_pb2.KeyType.RSA:
        raise ValueError(f"identity {identity_path} is not an RSA key")
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": data.data})  # DER, as hivemind pickles it
    return key


def public_key_text(key: RSAPrivateKey) -> str:
    """The OpenSSH text of `key`'s public half (``ssh-rsa AAAA...``)."""
    return key.get_public_key().to_bytes().decode()


@functools.lru_cache(maxsize=4096)
def peer_id_of_public_key(ssh_text: str) -> str | None:
    """The base58 peer id made of this RSA public key (libp2p peer-id spec), or None if it is not one."""
    try:
        public = RSAPublicKey.from_bytes(ssh_text.encode())._public_key
    except Exception:
        return None
    der = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    proto = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(multihash.encode(hashlib.sha256(proto).digest(), multihash.coerce_code("sha2-256"))).to_base58()


def owned_subkey(peer_id: str, ssh_text: str) -> str:
    return f"{peer_id}[owner:{ssh_text}]"


def owner_of(subkey: object) -> tuple[str | None, str | None]:
    """(the peer id a subkey claims, the peer id of the key that signed it). A well-formed
    honest subkey gives the same id twice; a subkey under someone else's id gives the forger
    as the second value; anything that is not an owned subkey gives (None, None)."""
    m = OWNED_SUBKEY.fullmatch(subkey) if isinstance(subkey, str) else None
    if m is None:
        return None, None
    return m.group(1), peer_id_of_public_key(m.group(2))


def signature_validator(identity_path: Path | str | None) -> RSASignatureValidator:
    """hivemind's validator signing with this identity's key (a throwaway key without one: a
    client that only reads still verifies every signature)."""
    return RSASignatureValidator(load_private_key(identity_path) if identity_path is not None else RSAPrivateKey())


def own_subkey(dht: hivemind.DHT, peer_id: str) -> str:
    """Our subkey in `dht`: our peer id and the public key its signature validator signs with.
    Raises ValueError for a DHT that signs nothing or signs with a key that is not its identity."""
    validators = getattr(getattr(dht, "_record_validator", None), "_validators", [])
    for v in validators:
        if isinstance(v, RSASignatureValidator):
            ssh = v.local_public_key[len(b"[owner:") : -1].decode()
            if peer_id_of_public_key(ssh) != peer_id:
                raise ValueError(f"the DHT of {peer_id} signs with another key than its identity")
            return owned_subkey(peer_id, ssh)
    raise ValueError("this DHT signs no records: start it with diloco_p2p.swarm.transport.dht.start_dht")
