"""The transport's error hierarchy: every failure of a call is a `TransportError`."""

from __future__ import annotations


class TransportError(Exception):
    """Base of every error raised by a transport call."""


class PeerUnreachable(TransportError):
    """The peer could not be reached, or its stream broke mid-call (it died, restarted or dropped us)."""


class CallTimeout(TransportError, TimeoutError):
    """The call did not complete within its timeout (a slow handler, a frozen or overloaded peer)."""


class WireError(TransportError):
    """A frame broke the wire format: malformed, oversized, wrong version, or undecodable tensors."""


class RemoteError(TransportError):
    """The peer answered with an error: its handler raised, or it refused the request.

    `kind` says which: "handler_error", "unknown_method", "timeout", "bad_request", "overloaded" or "banned".
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message
