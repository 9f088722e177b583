"""Starting and tearing down the default process group."""

from __future__ import annotations

import atexit
import os
import sys
import weakref
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as td

from distkit import _registry
from distkit._compat import destroy
from distkit.dist.world import forget_local_group
from distkit.utils import environ
from distkit.utils.device import BACKEND_DEVICES
from distkit.utils.groups import clear_group_cache

#: mmengine's third positional argument of init_dist (only torch is supported here).
_INIT_BACKENDS = ("torch", "deepspeed", "colossalai")
#: Worlds ``init_dist`` made in this process over ``env://`` (see :func:`_world_store`).
_worlds_made = 0


def infer_launcher() -> str:
    """Name of the launcher that started this process: pytorch, slurm, mpi or none.

    See :func:`distkit.utils.environ.detect_launcher` for the rules (and the reason,
    which ``distkit info`` prints).

    Examples:
        >>> import distkit.dist as dist
        >>> dist.infer_launcher() in ("pytorch", "slurm", "mpi", "none")
        True
    """
    return environ.detect_launcher()[0]


def default_backend(local_size: int = 1) -> str:
    """``nccl`` where CUDA is usable by ``local_size`` ranks per machine, else ``gloo``.

    CUDA is usable when it is available and there is a GPU for every local rank (NCCL
    refuses two ranks on one GPU).

    Args:
        local_size: Ranks per machine.

    Examples:
        >>> import torch
        >>> from distkit.dist import default_backend
        >>> default_backend() == ("nccl" if torch.cuda.is_available() else "gloo")
        True
    """
    if torch.cuda.is_available() and torch.cuda.device_count() >= max(local_size, 1):
        return "nccl"
    return "gloo"


def init_dist(
    launcher: str = "auto",
    backend: Optional[str] = None,
    timeout: Union[float, timedelta, None] = None,
    *,
    init_backend: str = "torch",
    **kwargs: Any,
) -> tuple[int, int]:
    """Start the default process group from the launcher's environment.

    ``pytorch`` reads torchrun's variables; ``slurm`` reads ``SLURM_PROCID``,
    ``SLURM_NTASKS``, ``SLURM_LOCALID`` and takes the master address from the first host of
    the node list (``MASTER_PORT``, the ``port`` keyword or 29500 for the port); ``mpi``
    reads Open MPI's ``OMPI_COMM_WORLD_*`` (or ``PMI_*``) variables; ``none`` starts
    nothing; ``auto`` picks one of those from the environment. The translated variables
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``) are exported to ``os.environ`` as torchrun would.

    With an accelerator backend, the current device is set to the local rank's before the
    group starts, so object collectives and NCCL never default every rank to GPU 0.

    A world this made and the script did not end with :func:`destroy_dist` is destroyed
    at exit, while the interpreter is still whole (left to the interpreter's teardown,
    gloo can abort the process after a run that succeeded).

    A process may make world after world (``init_dist``, ``destroy_dist``, ``init_dist``
    ...): over ``env://``, each world after the first keeps its rendezvous keys under a
    prefix of its own (``distkit/world1/``, ...), since a launcher's store outlives the
    worlds and a world must not read the addresses of the one before. Every rank must
    make the same worlds in the same order.

    Collective: every rank of the job must call this.
    Single process (``none``, or ``auto`` without launcher variables): starts nothing and
    returns ``(0, 1)``. Already initialized: returns the current ``(rank, world_size)``.

    Args:
        launcher: ``auto``, ``pytorch``, ``slurm``, ``mpi`` or ``none``.
        backend: ``None`` picks nccl where CUDA is usable, else gloo (see
            :func:`default_backend`); any torch backend string otherwise.
        timeout: Collective timeout in seconds or as a timedelta; ``None`` uses torch's.
            A string here is taken as mmengine's third positional argument,
            ``init_backend``.
        init_backend: Accepted for mmengine compatibility; only ``torch`` is supported.
        **kwargs: ``port`` (slurm and mpi), and anything else is passed to
            ``torch.distributed.init_process_group`` (e.g. ``init_method``, ``store``).

    Returns:
        ``(rank, world_size)``.

    Raises:
        ValueError: Unknown ``launcher`` or ``init_backend``.
        RuntimeError: The launcher's variables are missing.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.init_dist("none")
        (0, 1)
    """
    global _worlds_made
    if isinstance(timeout, str):
        if timeout not in _INIT_BACKENDS:
            raise TypeError(
                f"init_dist: timeout must be seconds or a timedelta, got str {timeout!r}"
            )
        init_backend, timeout = timeout, None  # mmengine's init_dist(l, b, "torch")
    if init_backend != "torch":
        raise ValueError(
            f"init_dist: init_backend={init_backend!r} is not supported; distkit runs on "
            "torch.distributed (init_backend='torch')"
        )
    if launcher != "auto" and launcher not in environ.LAUNCHERS:
        raise ValueError(
            f"init_dist: launcher must be one of auto, {', '.join(environ.LAUNCHERS)}; "
            f"got {launcher!r}"
        )
    pg = _registry.current._default_pg
    if pg is not None:
        return pg.rank(), pg.size()
    if launcher == "auto":
        launcher = environ.detect_launcher()[0]
    if launcher == "none":
        _registry.allow_alone()  # said in so many words: a world of one rank is meant
        _profile_run()
        return 0, 1
    env = environ.launcher_env(launcher, port=kwargs.pop("port", None))
    os.environ.update(env)
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_rank, local_size = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    backend = backend or default_backend(local_size)
    device_type = BACKEND_DEVICES.get(backend.split(":")[-1], "cpu")
    if device_type != "cpu":
        module = getattr(torch, device_type, None)
        if module is not None and module.device_count() > 0:
            module.set_device(local_rank % module.device_count())
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=timeout)
    options: dict[str, Any] = {"backend": backend, "rank": rank, "world_size": world}
    if timeout is not None:
        options["timeout"] = timeout
    if "store" not in kwargs:
        options["init_method"] = kwargs.pop("init_method", "env://")
    options.update(kwargs)
    fresh = options.get("init_method") == "env://"
    if fresh and _worlds_made:  # a world again in this process (after destroy_dist)
        options["store"] = _world_store(rank, world, timeout)
        del options["init_method"]
    td.init_process_group(**options)
    _worlds_made += fresh
    _destroy_at_exit(_registry.current._default_pg)
    _watch_world()
    _profile_run()
    return rank, world


def _world_store(rank: int, world: int, timeout: Optional[timedelta]) -> Any:
    """The rendezvous store of this process's next world over ``env://``, under a prefix
    of its own.

    A launcher's store (torchrun's agent, ``distkit launch``) outlives the worlds made on
    it, and ``env://`` gives each one the same keys: a second world read the first one's
    gloo addresses and failed to connect ("Connection refused"), in about half the runs.
    Every rank counts the worlds it made, so all of them agree on the prefix."""
    extra = {} if timeout is None else {"timeout": timeout}
    store, _, _ = next(td.rendezvous("env://", rank, world, **extra))
    return td.PrefixStore(f"distkit/world{_worlds_made}/", store)


def _destroy_at_exit(pg: Any) -> None:
    """Destroy the world ``init_dist`` made at exit, if the script did not: while the
    interpreter is still whole. Left to the interpreter's teardown, gloo's threads can
    drop the last reference to a tensor once Python is half gone, and the process aborts
    ("terminate called without an active exception") after a run that succeeded.

    Only a weak reference: a strong one would keep the group alive after the script's
    own ``destroy_dist``, so its gloo backend could not be let go (and its threads
    joined) until the interpreter's teardown, which is the abort this is here to avoid."""
    try:
        ref: Any = weakref.ref(pg)
    except TypeError:  # a group type without weak references: held, as before
        ref = lambda: pg  # noqa: E731

    def at_exit() -> None:
        default = _registry.current._default_pg
        if default is not None and ref() is default:  # still that world: nobody destroyed it
            try:
                destroy_dist()
            except Exception:  # the world is broken already: the exit goes on
                pass

    atexit.register(at_exit)


def _watch_world() -> None:
    """Set up, from the start, what lets the other ranks know about this one: the exit
    note it leaves on the store and the watchdog that answers roll calls (see
    :mod:`distkit.dist.guard.board`). Without ``init_dist``, the first collective does it."""
    from distkit.dist.core import comm as _comm
    from distkit.dist.guard import board as _board
    from distkit.dist.guard import watchdog as _watchdog

    pg = _registry.current._default_pg
    if pg is not None and pg.size() > 1 and _board.board() is not None:
        _watchdog.ensure(_comm._FACTS)


def _profile_run() -> None:
    """Open the whole run's profile when ``DISTKIT_PROFILE`` asks for one."""
    if os.environ.get("DISTKIT_PROFILE"):
        from distkit.dist import profiling

        profiling.start_run()


def destroy_dist() -> None:
    """Destroy the default process group and forget every cached group.

    Collective where torch's ``destroy_process_group`` is (every rank should call it).
    Single process: does nothing.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.destroy_dist()
    """
    if "distkit.dist.profiling" in sys.modules:  # DISTKIT_PROFILE: merged, then printed
        sys.modules["distkit.dist.profiling"].end_run()
    clear_group_cache()
    forget_local_group()
    if _registry.current._default_pg is not None:
        destroy()
