"""`procinfo`: the sockets the integration tests' loopback-only checks read from /proc find real sockets."""

from __future__ import annotations

import os
import socket

from procinfo import tcp_listeners_of, udp_sockets_of


def test_a_process_udp_sockets_and_tcp_listeners_are_found_with_their_addresses() -> None:
    me = os.getpid()
    with (
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp,
        socket.socket(socket.AF_INET) as listener,
        socket.socket(socket.AF_INET) as unlistened,
    ):
        udp.bind(("127.0.0.1", 0))
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        unlistened.bind(("127.0.0.1", 0))
        assert f"udp 127.0.0.1:{udp.getsockname()[1]} pid={me}" in udp_sockets_of([me])
        listening = tcp_listeners_of([me])
        assert f"tcp 127.0.0.1:{listener.getsockname()[1]} pid={me}" in listening
        assert not any(f":{unlistened.getsockname()[1]} " in line for line in listening)
        assert udp_sockets_of([]) == [] and tcp_listeners_of([]) == []
