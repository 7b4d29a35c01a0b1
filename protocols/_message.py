"""The base of every wire message: the registry of kinds and the limits and fields most messages share.

Modules that define messages subclass `Message` from here; `protocols.messages` encodes and decodes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from protocols._schema import Schema, count, text

MAX_TEXT = 1024  # longest string of any field
MAX_ID = 128  # run ids and peer ids
MAX_STAGE = 1024

RUN = text(MAX_ID, 1)  # a run id field
STAGE = count(MAX_STAGE)  # a stage field

KINDS: dict[str, type[Message]] = {}


@dataclass(frozen=True)
class Message(Schema):
    """Base of every message; `KIND` names it on the wire and registers it in `KINDS`."""

    KIND: ClassVar[str]

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "KIND" in vars(cls):
            KINDS[cls.KIND] = cls
