"""Emulated WAN links: what this node's transport sends to a peer at another site is delayed and paced.

`join --network FILE --site NAME` places a node at a site of a links file (`protocols.links`). Each message
this node's transport sends to a peer whose site it knows (a request before its stream is taken, a reply
before it is written, on either path) waits until its `Pacer` says it would have arrived: one pacer per
destination site, shared by every stream to that site, so concurrent transfers queue for the link's
bandwidth, and each message also takes the link's one-way latency. The whole message is held back and then
written at loopback speed (store and forward), which is how the SkipPipe cost model counts a hop:
latency + bytes / bandwidth.

Peers learn each other's sites from their DHT records (`NodeRecord.site`); a peer with no known site, or a
site this network does not have, is not emulated. Not emulated: the DHT's own traffic, refusals (answered
at once), and what another node sends (its own emulator delays it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from hivemind.p2p import PeerID

from protocols.links import Network, Pacer

logger = logging.getLogger(__name__)

MAX_FOREIGN_SITES_LOGGED = 16  # unknown sites warned about, at most (a peer's record names its own)


class LinkEmulator:
    """This node's site in `network`, its peers' sites, and a pacer per site it sends to."""

    def __init__(self, network: Network, site: str) -> None:
        self.network = network
        self.site = network.check_site(site)
        self._sites: dict[str, str] = {}  # peer id (base58) -> site
        self._pacers: dict[str, Pacer] = {}  # destination site -> its pacer
        self._foreign: set[str] = set()  # sites named by peers that this network lacks (logged once)

    def set_sites(self, sites: Mapping[str, str | None]) -> None:
        """Replace the known peers' sites (peer id -> site, None for a peer without one)."""
        known = {}
        for peer, site in sites.items():
            if site is None:
                continue
            if site in self.network.sites:
                known[peer] = site
            elif site not in self._foreign and len(self._foreign) < MAX_FOREIGN_SITES_LOGGED:
                self._foreign.add(site)
                logger.warning("peer %s names site %r, not one of this network's: not emulated", peer, site)
        self._sites = known

    def site_of(self, peer_id: PeerID) -> str | None:
        return self._sites.get(peer_id.to_base58())

    def delay(self, peer_id: PeerID, nbytes: int) -> float:
        """Hand `nbytes` for `peer_id` to its link now; the seconds until they arrive (0: not emulated)."""
        site = self.site_of(peer_id)
        if site is None:
            return 0.0
        pacer = self._pacers.get(site)
        if pacer is None:
            pacer = self._pacers[site] = Pacer(self.network.link(self.site, site))
        now = asyncio.get_running_loop().time()
        return pacer.send(now, nbytes) - now

    async def hold(self, peer_id: PeerID, nbytes: int) -> None:
        """Wait until `nbytes` sent now to `peer_id` would have arrived over the emulated link."""
        seconds = self.delay(peer_id, nbytes)
        if seconds > 0:
            await asyncio.sleep(seconds)
