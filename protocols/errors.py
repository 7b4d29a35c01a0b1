"""The one error hierarchy of the sans-I/O protocols.

`LocalProtocolError`: our own caller asked for something the protocol forbids (a bug or bad configuration
on this side). `RemoteProtocolError`: a peer sent something malformed, oversized, of another version or
otherwise unacceptable; the runtime rejects it, logs `reason` and may ban the sender.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base of every error raised by `protocols`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class LocalProtocolError(ProtocolError):
    """This side broke a rule: invalid arguments, an impossible plan, an inconsistent state."""


class RemoteProtocolError(ProtocolError):
    """A peer broke a rule: malformed, oversized, wrongly typed or wrong-version input."""
