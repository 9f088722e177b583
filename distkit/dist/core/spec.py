"""One spec per collective: what every layer needs to know of it, declared once.

A collective is its public function (:mod:`distkit.dist.tensor`,
:mod:`distkit.dist.objects`), its spec here, one method per backend
(:class:`~distkit.dist.backends.base.Backend`), and its tests. The tables other layers
used to keep each (what debug mode and the default check compare, which calls run
eagerly under ``torch.compile`` and why, the single-process shortcut) are derived from
:data:`SPECS`.

Torch-free, like :mod:`distkit.dist.core.shortcut`: a spec names types by string
(``"Tensor"``) and the public modules bind them.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional


class Spec(NamedTuple):
    """What distkit knows of one collective."""

    #: The backend method that runs it (the public name of most collectives; object
    #: collectives of one kind share one: ``broadcast_object`` runs both
    #: ``broadcast_object_list`` and ``broadcast_object``).
    method: str
    #: The fields of a call that every rank must pass alike (debug mode and the default
    #: check compare them; ``data.dtype`` is a field of a described tensor). Fields that
    #: only some calls promise (``data.shape`` with ``same_shape=True``) are added by
    #: :func:`distkit.dist.guard.debugmode.signature`.
    must_match: tuple[str, ...]
    #: When it traces under ``torch.compile`` (a sentence), or ``None``: never.
    traces: Optional[str]
    #: Why it runs eagerly between graphs when it does not trace (what follows its name
    #: in the graph break's reason).
    eager_reason: str
    #: The single-process shortcut (see :mod:`distkit.dist.core.shortcut`): the result,
    #: an expression of the parameters, and the conditions (parameter -> condition)
    #: under which the shortcut returns it; ``None`` when the collective has none. A
    #: result of ``None``: the call has no single-process result (``send``: there is no
    #: other rank), and the conditions only guard its lane on a process group.
    shortcut: Optional[tuple[Optional[str], dict[str, Any]]] = None
    #: Whether it is a point-to-point call (between pairs of ranks, not the whole group):
    #: it takes no call number on the group, and debug mode checks it with its peer.
    point_to_point: bool = False


_SIZES = (
    "cannot be traced with these arguments (it needs sizes only known at run time, or "
    "async_op=True returns a handle)"
)
_PICKLES = "pickles objects, which cannot be traced"
_BLOCKS = "blocks, which cannot be traced"
_PAIRS = (
    "moves data point to point, with shapes only the sender knows (and pickles objects), "
    "which cannot be traced"
)

_PLAIN_P2P = {"group": None, "tag": 0, "async_op": False}

#: Every collective, by backend method.
SPECS: dict[str, Spec] = {
    "all_reduce": Spec(
        "all_reduce",
        ("op", "data.dtype", "data.shape"),
        "every op",
        _SIZES,
        (
            "data",
            {"data": "Tensor", "op": ("sum", "mean"), "group": None, "async_op": False}
            | {"grad": False},
        ),
    ),
    "all_gather": Spec(
        "all_gather",
        ("data.dtype", "same_shape"),
        "with same_shape=True",
        _SIZES,
        (
            "[data]",
            {"data": "Tensor", "group": None, "async_op": False, "same_shape": (False, True)}
            | {"grad": False},
        ),
    ),
    "gather": Spec(
        "gather",
        ("dst", "data.dtype", "same_shape"),
        None,
        _SIZES,
        (
            "[data]",
            {"data": "Tensor", "dst": 0, "group": None, "async_op": False}
            | {"same_shape": (False, True)},
        ),
    ),
    "broadcast": Spec(
        "broadcast",
        ("src", "data.dtype", "data.shape"),
        "always",
        _SIZES,
        ("data", {"data": "Tensor", "src": 0, "group": None, "async_op": False}),
    ),
    "reduce": Spec(
        "reduce",
        ("dst", "op", "data.dtype", "data.shape"),
        None,
        _SIZES,
        (
            "data",
            {"data": "Tensor", "dst": 0, "op": ("sum", "mean"), "group": None}
            | {"async_op": False},
        ),
    ),
    "reduce_scatter": Spec("reduce_scatter", ("op", "data.dtype"), "always", _SIZES),
    "all_to_all": Spec("all_to_all", ("data.dtype", "same_shape"), None, _SIZES),
    "all_to_all_single": Spec(
        "all_to_all_single",
        ("data.dtype",),
        "with output_split_sizes given, or no sizes",
        _SIZES,
    ),
    "scatter": Spec("scatter", ("src",), None, _SIZES),
    "barrier": Spec("barrier", (), None, _BLOCKS, ("None", {"group": None})),
    "all_gather_object": Spec(
        "all_gather_object",
        ("serializer",),
        None,
        _PICKLES,
        (
            "[data]",
            {"data": "plain object", "group": None, "map_location": None} | {"serializer": None},
        ),
    ),
    "gather_object": Spec("gather_object", ("dst", "serializer"), None, _PICKLES),
    "broadcast_object": Spec("broadcast_object", ("src", "serializer"), None, _PICKLES),
    "scatter_object": Spec("scatter_object", ("src", "serializer"), None, _PICKLES),
    "all_to_all_object": Spec("all_to_all_object", ("serializer",), None, _PICKLES),
    # point to point: nothing must match across the group; a send pairs with its peer's
    # recv (see distkit.dist.guard.pairs)
    # (with every default, on a process group, they take the torch backend's lanes; with
    # none there is no other rank, and the checked path raises)
    "send": Spec("send", (), None, _PAIRS, (None, _PLAIN_P2P), point_to_point=True),
    "recv": Spec("recv", (), None, _PAIRS, (None, _PLAIN_P2P), point_to_point=True),
    "exchange": Spec("exchange", (), None, _PAIRS, point_to_point=True),
}

#: What every rank must pass alike, by backend method (debug mode, the default check)
MUST_MATCH: dict[str, tuple[str, ...]] = {m: s.must_match for m, s in SPECS.items()}


def eager_reason(method: str) -> str:
    """Why ``method`` runs eagerly between graphs (a graph break's reason)."""
    return f"distkit.dist.{method} {SPECS[method].eager_reason}: it runs eagerly between graphs"


def shortcut_of(method: str, types: dict[str, Any]) -> tuple[Optional[str], dict[str, Any]]:
    """The single-process shortcut of ``method`` with its type names bound (``types``:
    name -> class or predicate)."""
    spec = SPECS[method].shortcut
    assert spec is not None, f"{method} has no single-process shortcut"
    returns, when = spec
    return returns, {k: types.get(v, v) if isinstance(v, str) else v for k, v in when.items()}
