"""Timeouts that name names: which ranks never arrived at a collective, and where they are.

When a collective waits longer than its group's timeout, the rank posts where it is
waiting to the world's store, waits a few seconds (the *grace*) for the other ranks of
the group to post theirs, and raises :class:`CollectiveTimeoutError` naming the ranks
that never arrived and where they are waiting instead of the backend's bare timeout. A
post is removed when its rank leaves the collective, so a later timeout never reads an
earlier one's post. This costs one counter increment per collective until a timeout
happens.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from distkit import _settings
from distkit._compat import default_store
from distkit.dist.debug import call_site, group_label

if TYPE_CHECKING:
    from distkit.dist._comm import Comm


class CollectiveTimeoutError(RuntimeError):
    """A collective waited longer than its timeout.

    Attributes:
        missing: Group ranks that never arrived at this call.
        reports: What the other ranks posted about where they were waiting.
    """

    def __init__(self, message: str, missing: list[int], reports: dict[int, dict]) -> None:
        super().__init__(message)
        self.missing = missing
        self.reports = reports


def is_timeout(exc: BaseException) -> bool:
    """Whether a backend exception says a collective timed out."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _key(global_rank: int) -> str:
    return f"distkit/where/{global_rank}"


def _gather_posts(store: Any, me: int, others: list[int]) -> dict[int, dict]:
    """The other ranks' posts, waiting up to the grace for each to appear."""
    reports: dict[int, dict] = {}
    deadline = time.monotonic() + float(_settings.get("hang_grace"))
    pending = list(others)
    while pending and time.monotonic() < deadline:
        for r in list(pending):
            if store.check([_key(r)]):
                reports[r] = json.loads(store.get(_key(r)))
                pending.remove(r)
        if pending:
            time.sleep(0.1)
    return reports


def diagnose(comm: Comm, public: str, seq: int, exc: BaseException) -> CollectiveTimeoutError:
    """Ask the store where every rank of the group is; build the error to raise."""
    site = call_site()
    ranks = comm.global_ranks()
    me = ranks[comm.rank]
    where = {"group": ranks, "call": public, "seq": seq, "site": site}
    reports: dict[int, dict] = {}
    note = ""
    store = None
    try:
        store = default_store()
        store.set(_key(me), json.dumps(where))
        reports = _gather_posts(store, me, [r for r in ranks if r != me])
    except Exception as store_error:  # the store may be gone too
        note = f" (could not ask the other ranks through the store: {store_error})"
    finally:
        if store is not None:
            try:  # leaving this collective: a later timeout must not read this post
                store.delete_key(_key(me))
            except Exception:
                pass
    same, missing, elsewhere = [], [], []
    grace = float(_settings.get("hang_grace"))
    for group_rank, r in enumerate(ranks):
        if r == me:
            continue
        report = reports.get(r)
        here = report is not None and report["group"] == ranks and report["seq"] == seq
        if here and report is not None and report["call"] == public:
            same.append(group_rank)
            continue
        missing.append(group_rank)
        if report:
            group = "this group" if report["group"] == ranks else f"group {report['group']}"
            elsewhere.append(
                f"rank {group_rank} is waiting in {report['call']} (its call "
                f"#{report['seq']} on {group}) at {report['site']}"
            )
        else:
            elsewhere.append(
                f"rank {group_rank} posted nothing within {grace:g} s: it is not waiting "
                "in a distkit collective (busy, blocked elsewhere, or dead)"
            )
    lines = [
        f"{public} timed out on rank {comm.rank} of {comm.size} of {group_label(comm)} "
        f"(its call #{seq} on this group, at {site}){note}."
    ]
    if missing:
        lines.append(f"Rank(s) {', '.join(map(str, missing))} never arrived at this call:")
        lines += [f"  {line}" for line in elsewhere]
    if same:
        lines.append(f"Rank(s) {', '.join(map(str, same))} are waiting in this call too.")
    lines.append(f"The backend said: {exc}")
    by_group_rank = {ranks.index(r): v for r, v in reports.items()}
    return CollectiveTimeoutError("\n".join(lines), missing, by_group_rank)
