"""A node's libp2p identity: an Ed25519 key that its p2pd uses and that signs its DHT records.

An Ed25519 peer id (`12D3KooW...`) is the public key itself (an identity multihash of libp2p's protobuf
`PublicKey`), so anyone can check a signature against the peer id a record names, with no key exchange.
The private key is stored as libp2p's protobuf `PrivateKey` (the 32-byte seed then the public key), the file
p2pd reads with `-id`: the same key is the node's address on the network and its signing key.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

SIGNATURE_BYTES = 64
_IDENTITY_MULTIHASH = b"\x00"  # multihash code 0x00: the digest is the data itself


class IdentityError(ValueError):
    """An identity file that cannot be used, or a peer id that carries no Ed25519 key."""


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


@dataclass(frozen=True)
class Identity:
    """A private key and the peer id it makes."""

    key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def derived(cls, material: bytes) -> Identity:
        """The identity whose key is derived from `material` (SHA-256): the same material, the same peer
        id. Anyone who knows the material has the key: only for swarms that never leave one machine."""
        return cls(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(material).digest()))

    @classmethod
    def load(cls, path: Path) -> Identity:
        """Read an identity file written by `save` (or by libp2p tools: an Ed25519 protobuf private key)."""
        from google.protobuf.message import DecodeError
        from hivemind.proto import crypto_pb2

        try:
            message = crypto_pb2.PrivateKey.FromString(path.read_bytes())
        except (OSError, DecodeError) as error:
            raise IdentityError(f"cannot read the identity {path}: {error}") from None
        if message.key_type != crypto_pb2.KeyType.Ed25519 or len(message.data) not in (64, 96):
            raise IdentityError(f"{path} is not an Ed25519 libp2p private key")
        key = Ed25519PrivateKey.from_private_bytes(message.data[:32])
        if _raw_public(key.public_key()) != message.data[32:64]:
            raise IdentityError(f"{path}: the private and public halves of the key do not match")
        return cls(key)

    @classmethod
    def load_or_create(cls, path: Path) -> Identity:
        """The identity in `path`, created there (readable by its owner only) if the file does not exist."""
        if path.exists():
            return cls.load(path)
        identity = cls.generate()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise IdentityError(f"cannot create the folder of {path}: {error.strerror}") from None
        identity.save(path)
        return identity

    def save(self, path: Path) -> None:
        """Write the key as p2pd reads it, readable by its owner only (never over an existing file)."""
        data = self.key.private_bytes_raw() + self.public_key
        # libp2p's protobuf `PrivateKey` {key_type: Ed25519 (1), data: 64 bytes}, encoded here so that writing
        # a key (the launcher does, for every daemon) needs no protobuf classes and no hivemind import
        message = bytes([0x08, 0x01, 0x12, len(data)]) + data
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as error:
            raise IdentityError(f"cannot create the identity file {path}: {error.strerror}") from None
        with os.fdopen(descriptor, "wb") as file:
            file.write(message)

    @property
    def public_key(self) -> bytes:
        return _raw_public(self.key.public_key())

    @property
    def peer_id(self) -> str:
        from hivemind.p2p import PeerID
        from hivemind.proto import crypto_pb2

        public = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.Ed25519, data=self.public_key)
        encoded = public.SerializeToString()
        return PeerID(_IDENTITY_MULTIHASH + bytes([len(encoded)]) + encoded).to_base58()

    def sign(self, data: bytes) -> bytes:
        return self.key.sign(data)


@functools.lru_cache(maxsize=4096)
def public_key_of(peer_id: str) -> Ed25519PublicKey:
    """The Ed25519 key an `12D3KooW...` peer id carries; IdentityError for any other peer id. Cached: a node
    checks the records of the same few peers every second."""
    from google.protobuf.message import DecodeError
    from hivemind.p2p import PeerID
    from hivemind.proto import crypto_pb2

    try:
        raw = PeerID.from_base58(peer_id).to_bytes()
    except ValueError:
        raise IdentityError(f"{peer_id[:60]!r} is not a peer id") from None
    if raw[:1] != _IDENTITY_MULTIHASH or len(raw) < 2 or raw[1] != len(raw) - 2:
        raise IdentityError(f"peer id {peer_id[:60]} does not carry its public key")
    try:
        public = crypto_pb2.PublicKey.FromString(raw[2:])
    except DecodeError:
        raise IdentityError(f"peer id {peer_id[:60]} carries no valid public key") from None
    if public.key_type != crypto_pb2.KeyType.Ed25519 or len(public.data) != 32:
        raise IdentityError(f"peer id {peer_id[:60]} is not an Ed25519 key")
    return Ed25519PublicKey.from_public_bytes(public.data)


def verify(peer_id: str, data: bytes, signature: bytes) -> bool:
    """Whether `signature` over `data` was made by the key of `peer_id`."""
    try:
        public_key_of(peer_id).verify(signature, data)
    except (IdentityError, InvalidSignature):
        return False
    return True
