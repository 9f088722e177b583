"""Training-loop helpers built on the collectives: dicts of metrics, parameters, seeds."""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from distkit._compat import flatten_dense, unflatten_dense
from distkit.dist._route import resolve, untraced
from distkit.dist.core import args as _args
from distkit.dist.core.args import OpLike
from distkit.dist.core.comm import Comm, GroupLike
from distkit.dist.guard import record as _record
from distkit.dist.guard.debugmode import group_label
from distkit.dist.objects import all_gather_object
from distkit.dist.tensor import all_reduce, broadcast


def _buckets(tensors: list[Tensor], bucket_bytes: int) -> list[list[Tensor]]:
    """Group tensors by (dtype, device), then cut groups at ``bucket_bytes`` (-1: never)."""
    groups: dict[tuple, list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    out = []
    for group in groups.values():
        bucket: list[Tensor] = []
        size = 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if bucket and bucket_bytes > 0 and size + nbytes > bucket_bytes:
                out.append(bucket)
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        out.append(bucket)
    return out


def _reduce_coalesced(tensors: list[Tensor], op: str, group: GroupLike, bucket_bytes: int) -> None:
    for bucket in _buckets(tensors, bucket_bytes):
        flat = flatten_dense(bucket)
        all_reduce(flat, op, group)
        for t, reduced in zip(bucket, unflatten_dense(flat, bucket)):
            t.detach().copy_(reduced)


class _Words(NamedTuple):
    """How the layout check words what differs: for a dict of metrics, for a list of tensors."""

    name: str  # of the argument, as in data['loss'] or params[3]
    entry: str  # what it holds one of
    passed: str  # what the ranks passed, in the error's first line
    missing: str  # an entry some ranks lack: {name}, {key} (its repr) and {ranks}
    fix_missing: str
    keyed: bool  # lists each rank's entries with their keys ({k: ...}), or in order ([...])


_DICT = _Words(
    "data",
    "key",
    "dicts with different keys, dtypes or shapes",
    "key {key} is missing on {ranks}",
    "Every rank must reduce the same keys (add the missing ones, e.g. as zeros)",
    True,
)
_LIST = _Words(
    "params",
    "tensor",
    "different tensors: their number, dtypes or shapes differ",
    "{name}[{key}] is missing on {ranks} (they passed fewer tensors)",
    "Every rank must pass the same tensors in the same order (e.g. the same model's parameters())",
    False,
)


def _spelled(key: Any) -> str:
    """``repr(key)``, the same in every process: a frozenset's members (in a tuple or a
    namedtuple too) sorted, where ``repr`` lists them in an order that depends on the process's hash
    seed (strings hash differently in each), so two ranks would spell one key two ways."""
    if isinstance(key, frozenset):
        members = ", ".join(sorted(_spelled(k) for k in key))
        return f"{type(key).__name__}({{{members}}})" if key else f"{type(key).__name__}()"
    if type(key) is tuple:
        parts = [_spelled(k) for k in key]
        return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"
    fields = getattr(type(key), "_fields", None)
    if isinstance(key, tuple) and isinstance(fields, tuple):  # a namedtuple
        shown = ", ".join(f"{f}={_spelled(v)}" for f, v in zip(fields, key))
        return f"{type(key).__name__}({shown})"
    return repr(key)


def _order(key: Any) -> tuple[str, str, str]:
    """Where ``key`` of a dict goes in the order every rank visits: by ``str``, then (for
    keys that print alike, such as ``1`` and ``"1"``) by type and ``repr`` (spelled alike
    in every process: see :func:`_spelled`)."""
    if isinstance(key, (tuple, frozenset)):  # their str is their repr (namedtuples too)
        said = _spelled(key)
        return said, type(key).__qualname__, said
    return str(key), type(key).__qualname__, repr(key)


_STRINGS = {str}


def _sorted_keys(data: Mapping[Any, Any], fn: str, comm: Comm) -> list[Any]:
    """``data``'s keys in the order every rank visits them; refuses two keys that print
    alike and are of one type (two NaNs, objects whose ``repr`` leaves out what tells
    them apart): nothing that crosses between ranks says which of them is which, so their
    values would be paired by where the dict happens to hold them."""
    if {*map(type, data)} <= _STRINGS:  # the usual dict of metrics: sorted as by _order
        return sorted(data)
    spelled = {_order(k): k for k in data}
    if len(spelled) < len(data):
        seen: set[tuple[str, str, str]] = set()
        for key in data:
            said = _order(key)
            if said in seen:
                _args.fail(
                    ValueError,
                    fn,
                    comm,
                    f"data has two keys of type {said[1]} that print alike ({said[2]}): the "
                    "ranks cannot tell which of them is which",
                    "Give every key a str or repr of its own (e.g. use strings as keys)",
                )
            seen.add(said)
    return [spelled[said] for said in sorted(spelled)]


def _promoted(names: list[str]) -> Optional[str]:
    """The dtype torch promotes the named dtypes to, or ``None`` (float8 has no promotion)."""
    try:
        common = functools.reduce(torch.promote_types, [getattr(torch, n[6:]) for n in names])
    except (AttributeError, RuntimeError, TypeError):
        return None
    return str(common)


def _differences(
    layouts: list[list[tuple[str, str, tuple]]], words: _Words, ranks: list[int]
) -> tuple[list[str], list[str]]:
    """What differs between the ranks' layouts (``(key repr, dtype, shape)`` per key, of
    the global ``ranks``), key by key, and what to do about each kind of difference."""
    name = words.name
    per_key: dict[str, dict[int, tuple[str, tuple]]] = {}
    for rank, layout in zip(ranks, layouts):
        for key, dtype, shape in layout:
            per_key.setdefault(key, {})[rank] = (dtype, shape)
    problems, fixes = [], []
    every = ranks
    missing = {k: [r for r in every if r not in held] for k, held in per_key.items()}
    missing = {k: lacking for k, lacking in missing.items() if lacking}
    for key, lacking in missing.items():
        problems.append(words.missing.format(key=key, name=name, ranks=_args.ranks_said(lacking)))
    if missing:
        fixes.append(words.fix_missing)
    dtypes = {k: {r: d for r, (d, _) in held.items()} for k, held in per_key.items()}
    dtypes = {k: found for k, found in dtypes.items() if len(set(found.values())) > 1}
    for key, found in dtypes.items():
        problems.append(f"{name}[{key}] is {_args.by_value(found)}")
        fix = f"Give {name}[{key}] one dtype on every rank: cast it before the call"
        common = _promoted(sorted(set(found.values())))
        if common:
            fix += f", e.g. {name}[{key}] = {name}[{key}].to({common}) (what they promote to)"
        fixes.append(fix)
    shapes = {k: {r: s for r, (_, s) in held.items()} for k, held in per_key.items()}
    shapes = {k: seen for k, seen in shapes.items() if len(set(seen.values())) > 1}
    for key, seen in shapes.items():
        problems.append(f"{name}[{key}] has shape {_args.by_value(seen)}")
    if shapes:
        fixes.append(
            f"Give each {words.entry} one shape on every rank (its values add up element by "
            "element)"
        )
    return problems, fixes


#: Entries of each rank's layout, and differences, an error lists (then how many in all).
_SHOWN = 8


def _listed(items: list[str], what: str) -> list[str]:
    if len(items) <= _SHOWN:
        return items
    return [*items[:_SHOWN], f"... ({len(items)} {what} in all)"]


def _same_layout(
    data: Any,
    keys: list[Any],
    comm: Comm,
    fn: str,
    words: _Words = _DICT,
    refused: Optional[Exception] = None,
    options: Optional[dict[str, Any]] = None,
) -> None:
    """Check that every rank holds the same keys, dtypes and shapes (of a dict, or of a
    list by position), and passed the same ``options`` (the op, the bucketing: what
    decides the reductions that follow); raise on every rank.

    Different keys would otherwise line up silently (rank 0's ``b`` added to rank 1's
    ``c``) or hang; so would a list's tensors of one total size, flattened into one
    bucket. One 16-byte all_reduce of a digest of the layout, whose maximum and minimum
    agree only if every rank's digest does; only on a mismatch does a second round
    gather the layouts, to say which entry differs how, on which rank (by global rank,
    as the default check says it, with the rank in a sub-group beside it).

    The options are in the digest, so this check (made at every call) catches them where
    the default check does not look (a call site past its first calls: the helper's inner
    calls take its visits): ranks with another op would reduce each other's values with
    theirs, silently, and another bucketing would abort the backend.

    ``refused`` is this rank's own argument error (a value that is no tensor, an op its
    dtype refuses): this rank raises it, and every other rank one of its class naming
    this rank, instead of waiting in the reduction for this rank's next call.
    """
    if refused is None:
        shown = {name: str(value) for name, value in (options or {}).items()}
        entries = [(_spelled(k), str(data[k].dtype), tuple(data[k].shape)) for k in keys]
        mine: Any = (shown, entries)
        layout = "\n".join([*(f"{k}: {d} {s}" for k, d, s in entries), repr(shown)])
        digest = hashlib.blake2b(layout.encode(), digest_size=7).digest()
        value = int.from_bytes(digest, "little")
    else:  # past any digest: no other rank's check can agree
        value = -(2**62)
        mine = (_args.error_code(refused), _args.refused(refused, fn, comm))
    check = torch.tensor([value, -value], dtype=torch.int64, device="cpu")
    all_reduce(check, "max", comm.pg)
    if refused is None and check.tolist() == [value, -value]:
        return  # (ranks that all refused their arguments agree too: they go on)
    gathered = all_gather_object(mine, comm.pg)
    if refused is not None:
        raise refused
    for r, got in enumerate(gathered):
        if isinstance(got[0], int):  # its arguments: said as they are
            code, text = got
            _args.fail(_args.REMOTE_ERRORS[code], fn, comm, f"rank {r} {text}")
    chosen = [shown for shown, _ in gathered]
    layouts = [entries for _, entries in gathered]
    label = group_label(comm)
    if label == "the default group":
        ranks, whose = list(range(comm.size)), "the ranks"
        names = [f"rank {r}" for r in ranks]
    else:
        ranks, whose = comm.global_ranks(), f"the ranks of {label}"
        names = [f"rank {g} (rank {r})" for r, g in enumerate(ranks)]
    problems, fixes = _differences(layouts, words, ranks)
    differ = [o for o in chosen[0] if len({shown[o] for shown in chosen}) > 1]
    for option in reversed(differ):  # first: they decide what the entries mean
        values = dict(zip(ranks, (shown[option] for shown in chosen)))
        problems.insert(0, f"{option} is {_args.by_value(values)}")
    if differ:
        fixes.insert(0, f"Pass the same {' and '.join(differ)} on every rank")
    said = (
        f"passed {words.passed}"
        if len(problems) > len(differ)
        else "disagree on " + " and ".join(differ)
    )
    listing = "\n".join(
        f"  {name}: {_entries(layout, words)}" + "".join(f", {o}={shown[o]}" for o in differ)
        for name, layout, shown in zip(names, layouts, chosen)
    )
    _args.fail(
        ValueError,
        fn,
        comm,
        f"{whose} {said}: {'; '.join(_listed(problems, 'differences'))}\n{listing}\n",
        ". ".join(fixes),
    )


def _entries(layout: list[tuple[str, str, tuple]], words: _Words) -> str:
    """One rank's layout as its error lists it: ``{'a': dtype shape, ...}`` or ``[...]``."""
    if words.keyed:
        return "{" + ", ".join(_listed([f"{k}: {d} {s}" for k, d, s in layout], "keys")) + "}"
    return "[" + ", ".join(_listed([f"{d} {s}" for _, d, s in layout], "tensors")) + "]"


@untraced("all_reduce_dict", "checks the dict's layout on every rank, then sends one message")
def all_reduce_dict(
    data: Mapping[Any, Tensor], op: OpLike = "sum", group: GroupLike = None
) -> Mapping[Any, Tensor]:
    """Reduce every tensor of a dict across ranks, in place, in one call per dtype.

    Collective: every rank in ``group`` must call this with the same keys.
    Single process: returns ``data`` unchanged.

    Keys are visited in sorted order (by ``str``, then type and ``repr``), so ranks that
    built their dicts in different orders still line up; two keys of one type that print
    alike (two NaNs) are refused, as no rank could tell which is which. The tensors are updated in
    place (as in mmengine) and the dict is returned. Values are flattened into one buffer
    per dtype and device, so ten metrics cost one all_reduce, not ten, plus one 16-byte
    all_reduce first that checks every rank holds the same keys, dtypes and shapes, and
    passed the same ``op`` (else every rank raises ``ValueError`` saying which key is
    missing, or has which dtype or shape, or which op, on which rank, and what to do,
    rather than adding one rank's ``b`` to another's ``c``, or one rank's maximum to the
    others' sums). The check runs at every call, not only where the default check looks.

    Args:
        data: Metric name to tensor (any shapes).
        op: Any op of :func:`all_reduce`; ``mean`` averages each metric over ranks.
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).

    Returns:
        ``data``, its tensors holding the reductions.

    Raises:
        TypeError: ``data`` is not a mapping of tensors, or ``op`` does not apply to a
            value's dtype.
        ValueError: ``op`` is not a known name, two keys of one type print alike, or
            the ranks' dicts differ in keys, dtypes or shapes, or their ``op``.

    Examples:
        >>> import torch
        >>> import distkit.dist as dist
        >>> dist.all_reduce_dict({"loss": torch.tensor(0.5), "acc": torch.tensor(0.75)}, "mean")
        {'loss': tensor(0.5000), 'acc': tensor(0.7500)}

        With 2 ranks::

            dist.all_reduce_dict({"n": torch.tensor(dist.get_rank() + 1)})
            # every rank: {'n': tensor(3)}
    """
    fn = "all_reduce_dict"
    comm = resolve(group, fn)

    def checked() -> tuple[_args.Op, list[Any]]:
        if not isinstance(data, Mapping):
            _args.fail(
                TypeError, fn, comm, f"data must be a dict of tensors, got {_args.show(data)}"
            )
        rop = _args.op_of(op, fn, comm)
        keys = _sorted_keys(data, fn, comm)
        for k in keys:
            _args.tensor(data[k], f"data[{k!r}]", fn, comm)
            _args.check_dtype(rop, data[k], f"data[{k!r}]", fn, comm)
        return rop, keys

    try:
        rop, keys = checked()
    except (TypeError, ValueError) as refused:  # on a group: said to every rank first
        if comm.alone:
            raise
        _same_layout(None, [], comm, fn, _DICT, refused)
    with _record.collector(fn, data.values()):  # one call in a profile
        if comm.alone:
            return data
        _same_layout(data, keys, comm, fn, options={"op": rop.name})
        if keys:
            _reduce_coalesced([data[k] for k in keys], rop.name, comm.pg, -1)
    return data


@untraced("all_reduce_params", "reduces the tensors in buckets, one message each")
def all_reduce_params(
    params: Iterable[Tensor],
    coalesce: bool = True,
    bucket_size_mb: float = -1,
    op: OpLike = "sum",
    group: GroupLike = None,
) -> list[Tensor]:
    """Reduce parameters (or any tensors) across ranks, in place.

    Collective: every rank in ``group`` must call this with matching tensors.
    Single process: returns the tensors unchanged.

    One 16-byte all_reduce first checks that every rank passed as many tensors, with the
    same dtypes and shapes, in the same order, and the same ``op``, ``coalesce`` and
    bucket size: else every rank raises ``ValueError`` saying what differs how on which
    rank (tensors of one total size would otherwise be flattened into one bucket and
    added across each other silently, and another bucketing aborts the backend). The
    check runs at every call, not only where the default check looks.

    Args:
        params: Tensors or ``nn.Parameter`` s, e.g. ``model.parameters()`` (a generator
            is fine); parameters are reduced through ``.data``.
        coalesce: Flatten tensors of one dtype into buckets (one all_reduce per bucket)
            instead of one all_reduce per tensor.
        bucket_size_mb: Bucket size limit in MiB; ``-1`` (any size up to 0, or ``inf``)
            puts each dtype in one bucket.
        op: Any op of :func:`all_reduce`.
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).

    Returns:
        The tensors, as a list, now holding the reductions (same objects as passed in).

    Raises:
        TypeError: An element is not a tensor, or ``op`` does not apply to its dtype.
        ValueError: ``op`` is not a known name, or the ranks' tensors differ in number,
            dtypes or shapes, or their ``op``, ``coalesce`` or ``bucket_size_mb``.

    Examples:
        >>> import torch
        >>> import distkit.dist as dist
        >>> layer = torch.nn.Linear(2, 1)
        >>> out = dist.all_reduce_params(layer.parameters(), op="mean")
        >>> [tuple(p.shape) for p in out]
        [(1, 2), (1,)]
    """
    fn = "all_reduce_params"
    comm = resolve(group, fn)
    tensors = list(params)

    def checked() -> tuple[_args.Op, int]:
        rop = _args.op_of(op, fn, comm)
        _args.flag(coalesce, "coalesce", fn, comm)
        if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float)):
            _args.fail(
                TypeError,
                fn,
                comm,
                f"bucket_size_mb must be a number, got {_args.show(bucket_size_mb)}",
                "Pass a size in MiB, or -1 for one bucket per dtype",
            )
        if bucket_size_mb != bucket_size_mb:  # NaN
            _args.fail(
                ValueError,
                fn,
                comm,
                "bucket_size_mb must be a number of MiB, got nan",
                "Pass a size in MiB, or -1 (or inf) for one bucket per dtype",
            )
        for i, t in enumerate(tensors):
            _args.tensor(t, f"params[{i}]", fn, comm)
            _args.check_dtype(rop, t, f"params[{i}]", fn, comm)
        # -1 (any size <= 0) and inf: no limit, one bucket per dtype
        limited = 0 < bucket_size_mb < float("inf")
        return rop, int(bucket_size_mb * 1024 * 1024) if limited else -1

    try:
        rop, bucket_bytes = checked()
    except (TypeError, ValueError) as refused:  # on a group: said to every rank first
        if comm.alone:
            raise
        _same_layout(None, [], comm, fn, _LIST, refused)
    with _record.collector(fn, tensors):  # one call in a profile
        if comm.alone:
            return tensors
        data = [t.data for t in tensors]
        options: dict[str, Any] = {"op": rop.name, "coalesce": bool(coalesce)}
        # every rank names the same options (the digest compares them all): without
        # coalesce the bucket size does not apply
        options["bucket_size_mb"] = (
            (bucket_bytes / 2**20 if bucket_bytes > 0 else -1) if coalesce else "unset"
        )
        _same_layout(data, list(range(len(data))), comm, fn, _LIST, options=options)
        if coalesce:
            _reduce_coalesced(data, rop.name, group, bucket_bytes)
        else:
            for t in data:
                all_reduce(t, rop.name, group)
    return tensors


def _draw_seed() -> int:
    try:
        import numpy as np
    except ImportError:  # NumPy is optional for distkit
        return random.randrange(2**31)
    return int(np.random.randint(2**31))


@untraced("sync_random_seed", "draws a new seed at every call, which a graph would freeze")
def sync_random_seed(group: GroupLike = None) -> int:
    """Draw a random seed on rank 0 and give it to every rank.

    Use it to make samplers shuffle identically on every rank.

    As in mmengine, every rank draws once from NumPy's global generator (so
    ``np.random.seed(0)`` makes the result repeatable, and each rank's generator moves on
    by one draw), and rank 0's draw wins. Without NumPy, Python's ``random`` draws.

    Collective: every rank in ``group`` must call this.
    Single process: returns a fresh random seed.

    Args:
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).

    Returns:
        An int in ``[0, 2**31)``, the same on every rank.

    Examples:
        >>> import distkit.dist as dist
        >>> 0 <= dist.sync_random_seed() < 2**31
        True
    """
    comm = resolve(group, "sync_random_seed")
    seed = _draw_seed()
    with _record.collector("sync_random_seed"):  # one call in a profile
        if comm.alone:
            return seed
        t = torch.tensor([seed], dtype=torch.int64, device="cpu")
        return int(broadcast(t, 0, group).item())
