"""Sans-I/O protocols of swarmnode: SkipPipe scheduling, NoLoCo outer steps, CheckFree recovery and the
wire messages. Pure state and math: no sockets, no clocks, no hivemind; time and randomness come in as
arguments."""

from protocols.errors import LocalProtocolError, ProtocolError, RemoteProtocolError

__all__ = ["LocalProtocolError", "ProtocolError", "RemoteProtocolError"]
