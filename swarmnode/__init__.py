"""swarmnode: a peer-to-peer swarm training daemon."""

__version__ = "0.4.0"
