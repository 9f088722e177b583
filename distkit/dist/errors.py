"""The errors distkit raises when ranks misbehave (argument errors are torch's own types).

Every one of them is raised on every rank involved, not only on the rank at fault.
"""

from __future__ import annotations

import pickle


class CollectiveMismatchError(RuntimeError):
    """The ranks of a group are not in the same collective, or disagree on it.

    Raised by debug mode (every call) and by the default check (the first calls at each
    call site, and a sample), before the backend runs.

    Attributes:
        calls: Each rank's call, as ``{"call": ..., "fields": ..., "site": ...}``.
    """

    def __init__(self, message: str, calls: list[dict]) -> None:
        super().__init__(message)
        self.calls = calls


class CollectiveTimeoutError(RuntimeError):
    """A collective waited longer than its timeout.

    Attributes:
        missing: Global ranks not waiting in this call: those that never arrived, and
            those that finished it while this rank still waits (a call some ranks
            finish first, called with another ``dst`` or ``src`` on some ranks).
        reports: What the other ranks posted about where they were waiting, by global rank.
    """

    def __init__(self, message: str, missing: list[int], reports: dict[int, dict]) -> None:
        super().__init__(message)
        self.missing = missing
        self.reports = reports


class RankGoneError(RuntimeError):
    """A rank of the group went away (exited, or was killed) while this rank waited for it
    in a collective.

    Attributes:
        gone: What is known of each rank that went away, by global rank: its exit note
            (``{"how": ..., "code": ..., "error": ...}``), empty for a rank that left none.
    """

    def __init__(self, message: str, gone: dict[int, dict]) -> None:
        super().__init__(message)
        self.gone = gone


class UnsafeObjectError(pickle.UnpicklingError):
    """The safe serializer refused an object another rank sent; none of it ran.

    Attributes:
        rank: The rank that sent the object.
        global_name: ``module.name`` of the refused global, if a global was refused.
    """

    def __init__(self, message: str, rank: int = -1, global_name: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.global_name = global_name
