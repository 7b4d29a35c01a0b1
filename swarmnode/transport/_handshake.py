"""The encrypted direct path's handshake: an ephemeral X25519 exchange signed by both libp2p identities.

The caller holds a one-time token that the callee granted it over libp2p (so the callee knows which peer id
the token is for), and dials the callee's direct port:

    caller -> callee   b"SWNE", token (16), caller's ephemeral X25519 key (32)
    callee -> caller   callee's ephemeral key (32), sign_callee(b"server" + T) (64)
    caller -> callee   sign_caller(b"client" + T) (64), then sealed records (`_channel`)

    T = SHA-256(LABEL, token, caller's key, callee's key, callee's peer id, caller's peer id)

Each side signs with its libp2p Ed25519 identity key, and each checks the other's signature against the peer
id it expects: the caller against the peer it dialled, the callee against the peer its token was granted to.
A peer that cannot sign for that peer id is refused (logged, counted in `TransportStats.refused["identity"]`).
Both signatures cover both ephemeral keys and both peer ids, so a signature is good for this connection
only; the keys of each direction are HKDF-SHA256 of the X25519 secret salted with T, fresh per connection
(forward secret: the ephemeral keys are never stored).
"""

from __future__ import annotations

import hashlib
import logging
import struct
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hivemind.p2p import PeerID

from swarmnode.identity import SIGNATURE_BYTES, Identity, verify
from swarmnode.transport._channel import Channel
from swarmnode.transport._errors import WireError

logger = logging.getLogger(__name__)

SEALED_MAGIC = b"SWNE"  # first bytes of an encrypted direct connection
PLAIN_MAGIC = b"SWND"  # first bytes of a plaintext (loopback) direct connection
TOKEN_BYTES = 16
KEY_BYTES = 32
LABEL = b"swarmnode direct v1"
CALLER_HELLO = struct.Struct(f"<{TOKEN_BYTES}s{KEY_BYTES}s")  # after the magic
CALLEE_REPLY = struct.Struct(f"<{KEY_BYTES}s{SIGNATURE_BYTES}s")


class IdentityRefused(WireError):
    """The other side of a direct connection could not prove it holds the key of the peer id expected."""


@dataclass(frozen=True)
class Keys:
    """The two directions' AEADs of one connection."""

    seal: AESGCM
    unseal: AESGCM


def _transcript(token: bytes, caller_key: bytes, callee_key: bytes, callee: PeerID, caller: PeerID) -> bytes:
    digest = hashlib.sha256(LABEL)
    for part in (token, caller_key, callee_key, callee.to_bytes(), caller.to_bytes()):
        digest.update(len(part).to_bytes(2, "big") + part)
    return digest.digest()


def _keys(ephemeral: X25519PrivateKey, theirs: bytes, transcript: bytes, caller: bool) -> Keys:
    try:
        secret = ephemeral.exchange(X25519PublicKey.from_public_bytes(theirs))
    except ValueError:  # a low-order point: the shared secret would be all zeros
        raise WireError("a degenerate ephemeral key") from None
    material = HKDF(hashes.SHA256(), 32, transcript, LABEL + b" keys").derive(secret)
    to_callee, to_caller = AESGCM(material[:16]), AESGCM(material[16:])
    return Keys(to_callee, to_caller) if caller else Keys(to_caller, to_callee)


async def dial(channel: Channel, identity: Identity, me: PeerID, callee: PeerID, token: bytes) -> Keys:
    """The caller's side; raises IdentityRefused if the callee cannot sign as `callee`."""
    ephemeral = X25519PrivateKey.generate()
    mine = ephemeral.public_key().public_bytes_raw()
    channel.write_raw(SEALED_MAGIC + CALLER_HELLO.pack(token, mine))
    theirs, signature = CALLEE_REPLY.unpack(await channel.read_raw(CALLEE_REPLY.size))
    transcript = _transcript(token, mine, theirs, callee, me)
    if not verify(callee.to_base58(), b"server" + transcript, signature):
        logger.warning(
            "refused the direct path to %s (%s): its answer is not signed by it", callee, channel.peername
        )
        raise IdentityRefused(f"the direct path of {callee} did not prove its identity")
    keys = _keys(ephemeral, theirs, transcript, caller=True)
    channel.write_raw(identity.sign(b"client" + transcript))
    return keys


async def accept(
    channel: Channel, identity: Identity, me: PeerID, caller: PeerID, token: bytes, key: bytes
) -> Keys:
    """The callee's side, once the caller's hello (`token`, its ephemeral `key`) was read and the token found
    granted to `caller`; raises IdentityRefused if the caller cannot sign as `caller`."""
    ephemeral = X25519PrivateKey.generate()
    mine = ephemeral.public_key().public_bytes_raw()
    transcript = _transcript(token, key, mine, me, caller)
    keys = _keys(ephemeral, key, transcript, caller=False)
    channel.write_raw(CALLEE_REPLY.pack(mine, identity.sign(b"server" + transcript)))
    signature = await channel.read_raw(SIGNATURE_BYTES)
    if not verify(caller.to_base58(), b"client" + transcript, signature):
        raise IdentityRefused(f"a direct connection for {caller} is not signed by it")
    return keys


async def read_hello(channel: Channel) -> tuple[bool, bytes, bytes]:
    """The first bytes of an inbound direct connection: (sealed, token, caller's ephemeral key or b"");
    WireError for anything else."""
    magic = await channel.read_raw(len(SEALED_MAGIC))
    if magic == SEALED_MAGIC:
        token, key = CALLER_HELLO.unpack(await channel.read_raw(CALLER_HELLO.size))
        return True, token, key
    if magic == PLAIN_MAGIC:
        return False, await channel.read_raw(TOKEN_BYTES), b""
    raise WireError(f"bad direct-path magic {magic!r}")
