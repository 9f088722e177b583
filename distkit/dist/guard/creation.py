"""Every rank creates the same process group: checked on the world's store first.

Creating a group (``torch.distributed.new_group``, which :func:`distkit.utils.get_group`
calls) is a collective of the whole world: every rank must create every group, in the
same order, members or not. torch numbers the groups it creates and pairs the ranks by
that number alone, so ranks that name different rank lists at the same step (each rank
only its own data-parallel group, or the same groups in another order) are joined into
groups they did not ask for: ranks 1 and 2 reduce with each other inside "``[1, 3]``" and
"``[0, 2]``", silently, while the others wait for ever.

So before torch creates a group, each rank posts what it creates (the ranks, the
backend, the timeout, its call site) under the world's creation number, and reads every
rank's: ranks that disagree raise ``ValueError`` on every rank, naming what each
created; a rank that will not come (it exited, or waits in a collective that needs
this rank: the group was created on its members only) is raised on at once; one busy
elsewhere is reported after ``DISTKIT_STUCK_AFTER`` seconds (where it is) and named in
the ``CollectiveTimeoutError`` raised at the world's timeout. Group creation is rare
(once per group and world), so the few store operations cost nothing that matters; the
collectives themselves are untouched.
"""

from __future__ import annotations

import sys
import time
from typing import Optional

from distkit import _settings
from distkit._compat import group_timeout
from distkit.dist import errors
from distkit.dist.core.args import by_value
from distkit.dist.guard import board as _board
from distkit.dist.guard import check as _check
from distkit.dist.guard import debugmode
from distkit.dist.guard import watchdog as _watchdog
from distkit.utils import groups as _groups

_FIX = (
    "Every rank must create every group, in the same order, members or not (creating a "
    "group is a collective of the whole world): e.g. groups = [get_group(r) for r in "
    "([0, 2], [1, 3])] on every rank, then use its own"
)


def agree(ranks: tuple[int, ...], backend: str, seconds: Optional[float]) -> None:
    """Check with every rank of the world that it creates this group (``ranks``,
    ``backend``, ``seconds``) now; raise ``ValueError`` on every rank if they differ."""
    board = _board.board()
    if board is None or board.size == 1:
        return
    k = board.groups + 1
    site = debugmode.call_site()
    what = f"get_group({list(ranks)}) (the world's group creation #{k}) at {site}"
    if board.dead:
        _store_gone(board, what, None)
        return
    board.groups = k
    mine = {"ranks": list(ranks), "backend": backend, "timeout": seconds, "site": site}
    keys = {r: board.key("group", k, r) for r in range(board.size)}
    try:
        board.post(keys[board.rank], mine)
        posts = _await(board, keys, k, what)
    except (errors.CollectiveTimeoutError, errors.CollectiveMismatchError, errors.RankGoneError):
        # nothing was created: the number is taken again by this rank's next creation,
        # which is the missing ranks' first (its post goes, or they would read it)
        board.groups -= 1
        try:
            board.store.delete_key(keys[board.rank])
        except Exception:  # a store without deletion: a later post writes over it
            pass
        raise
    except RuntimeError as exc:  # the store failed (what torch raises for it)
        board.dead = True
        _store_gone(board, what, exc)
        return  # a launcher's store or a file: create unchecked
    said = {r: _said(post, posts) for r, post in sorted(posts.items())}
    if len(set(said.values())) > 1:  # as get_group's other errors: the caller says where
        where = {r: f"{said[r]} at {post['site']}" for r, post in sorted(posts.items())}
        raise ValueError(
            f"get_group: the ranks create different process groups at the world's group "
            f"creation #{k}: {by_value(where)}. {_FIX}"
        )


def _store_gone(board: _board.Board, what: str, exc: Optional[BaseException]) -> None:
    """The world's store failed (``exc``) or went before: under ``env://`` alone its host,
    rank 0, went away with it, and torch's creation of the group, which meets on the
    store, would fail with the store's own error (raise the rank's instead)."""
    if board.host is None or board.host == board.rank:
        return
    said = f". The store said: {exc}" if exc is not None else ""
    raise errors.RankGoneError(
        f"get_group: rank {board.host} is gone, and the store it hosted with it while rank "
        f"{board.rank} waited in {what}{said}",
        {board.host: {}},
    ) from None


def _said(post: dict, posts: dict[int, dict]) -> str:
    """What a rank creates, with the backend and timeout where the ranks differ on them."""
    text = str(post["ranks"])
    for field in ("backend", "timeout"):
        if len({repr(p[field]) for p in posts.values()}) > 1:
            text += f" ({field} {post[field]})"
    return text


def _await(board: _board.Board, keys: dict[int, str], k: int, what: str) -> dict:
    """Every rank's post for creation ``k``. Ranks that have not come are asked where
    they are (after half a second, then less and less often): one that exited, or waits
    in a collective or a receive that needs this rank (it skipped the creation: a group
    made on its members only), is raised on at once; one busy elsewhere is reported after
    ``DISTKIT_STUCK_AFTER`` seconds, and raised on at the world's timeout."""
    pg = board.pg()
    timeout = group_timeout(pg) if pg is not None else None
    limit = timeout.total_seconds() if timeout is not None else 1800.0
    start = time.monotonic()
    stuck = float(_settings.get("stuck_after"))
    reported = stuck <= 0
    every = min(_check.ASK_AFTER, limit / 4)  # as the default check asks
    ask_at, roll = start + every, None
    posts: dict[int, dict] = {}
    while True:
        posts.update(board.collect({r: key for r, key in keys.items() if r not in posts}, 0.0))
        if len(posts) == len(keys):
            return posts
        now = time.monotonic()
        missing = [r for r in keys if r not in posts]
        if roll is not None:
            _raise_if_stuck_for_good(board, roll, missing, what)
        if now >= ask_at:
            roll = board.ask({"kind": "where", "group": missing, "from": board.rank})
            every = min(every * 2, 8.0)
            ask_at = now + every
        if not reported and now - start >= stuck:
            reported = True
            print(_late(board, missing, what, now - start), file=sys.stderr, flush=True)
        if now - start >= limit:
            raise errors.CollectiveTimeoutError(
                f"get_group timed out on rank {board.rank} in {what} after {limit:g} s: "
                f"{', '.join(f'rank {r}' for r in missing)} never came to create a group. "
                f"{_FIX}",
                missing,
                {},
            )
        time.sleep(_board.POLL)


def _raise_if_stuck_for_good(board: _board.Board, roll: int, missing: list[int], what: str) -> None:
    """Raise when a rank that has not come never will: it exited, or it waits (in its
    main thread) for this rank in a collective or a point-to-point call."""
    gone = board.exits(missing)
    if gone:
        said = "; ".join(_board.describe_exit(r, note) for r, note in sorted(gone.items()))
        raise errors.RankGoneError(
            f"get_group: {said}, while rank {board.rank} waited in {what} for it. {_FIX}", gone
        )
    me = board.rank
    for r, answer in sorted(board.answers(roll, missing, 0.0).items()):
        # only its main thread's call (another thread's may wait for one of this rank's
        # other threads), and not one this rank made already (it still decodes the result)
        waits = [
            c
            for c in answer.get("in", ())
            if me in c["group"] and c.get("main", True) and not _check.entered(c["gid"], c["seq"])
        ]
        waits += [c for c in answer.get("p2p", ()) if me in c["peers"] and c.get("main", True)]
        if waits:
            there = waits[0]
            raise errors.CollectiveMismatchError(
                f"get_group: rank {r} waits in {there['call']} at {there['site']}, which "
                f"needs rank {me}, while rank {me} waits in {what} for rank {r}: the group "
                f"is created on some ranks only (on rank {me} of {board.size}). {_FIX}",
                [],
            )


def _late(board: _board.Board, missing: list[int], what: str, waited: float) -> str:
    """The stuck report of a group creation: where the ranks that have not come are."""
    answers, exits = board.where(list(range(board.size)), missing, _watchdog.ANSWERS_WITHIN)
    lines = [f"distkit: rank {board.rank} has waited {waited:.0f} s in {what}:"]
    lines += [f"  {_watchdog.where_is(r, answers.get(r), exits)}" for r in missing]
    lines.append(
        "Creating a group is a collective of the whole world: every rank must create it. "
        "distkit keeps waiting until the world's timeout."
    )
    return "\n".join(lines)


def _install() -> None:
    _groups.agree = agree


_install()
