"""The names of the phases every rank goes through together, in one place."""

from __future__ import annotations

from enum import Enum


class Phase(str, Enum):
    """A step that ends with every rank agreeing on its outcome.

    save: ENTRY -> COLLECT -> WRITE -> COMMIT; load: ENTRY -> PLAN -> READ -> RESTORE;
    ``shardsafe.interop``'s gather: ENTRY -> OFFER -> DONE; the tiered manager:
    ENTRY -> SURVEY (what each rank holds, or needs) -> FETCH (peer transfers); a save
    replacing a name on an object store first agrees where it goes: ENTRY -> PLACE.
    """

    ENTRY = "entry"
    COLLECT = "collect"
    WRITE = "write"
    COMMIT = "commit"
    PLAN = "plan"
    READ = "read"
    RESTORE = "restore"
    OFFER = "offer"
    DONE = "done"
    SURVEY = "survey"
    FETCH = "fetch"
    PLACE = "place"

    def __str__(self) -> str:
        return self.value
