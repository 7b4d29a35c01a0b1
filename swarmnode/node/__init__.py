"""The daemon: one node of one stage, its routing, stepping, averaging and recovery."""
