"""The loop each rank process of a :class:`~distkit.local.pool.RankPool` runs.

A worker joins a gloo world through a FileStore (no ports), then runs the tasks the
parent sends, one at a time, and answers each with its result or its traceback. After
each task, when the parent says every rank has answered, the ranks meet in a barrier and
put back what the task may have changed (environment variables, distkit settings,
cached groups); a rank that cannot meet the others reports the world broken. If the
parent goes away, so does the worker.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import io
import os
import pickle
import select
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional


@dataclass
class FnRef:
    """A function named by module and qualified name.

    Test bodies decorated with ``@ranks`` are hidden behind their pytest wrapper, so they
    cannot be pickled by reference; this resolves the wrapper back to the body.
    """

    module: str
    qualname: str

    @classmethod
    def of(cls, fn: Any) -> Any:
        body = getattr(fn, "__distkit_body__", fn)
        module = getattr(body, "__module__", None)
        qualname = getattr(body, "__qualname__", "")
        if module and "<locals>" not in qualname and "<lambda>" not in qualname:
            return cls(module, qualname)
        return fn  # let pickle try (and fail with its own message)

    def resolve(self) -> Any:
        obj: Any = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return getattr(obj, "__distkit_body__", obj)


@dataclass
class Failure:
    """A task that raised on one rank, in a form that always crosses a pipe."""

    rank: int
    type_name: str
    message: str
    traceback: str
    exception: Optional[bytes]  # the pickled exception, when it pickles

    def rebuild(self) -> Optional[BaseException]:
        if self.exception is None:
            return None
        try:
            return pickle.loads(self.exception)
        except Exception:
            return None


PR_SET_PDEATHSIG = 1


def _prctl() -> Optional[Callable[..., int]]:
    """libc's ``prctl`` on Linux, else ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(parent: Optional[int]) -> Callable[[], None]:
    """A function that makes the process calling it die (SIGKILL) when its parent dies.

    Linux only asks this of a parent that is still alive: when ``parent`` (the pid that
    started this process) is already gone by then, the process is an orphan and the
    function exits it at once. ``prctl`` is looked up here, in the parent, so the result
    is safe as ``subprocess.Popen(preexec_fn=...)``, where it runs before the child's
    program does: no window in which a SIGKILLed launcher leaves a rank behind.

    Args:
        parent: The pid this process was started by, or ``None`` to skip that check.

    Returns:
        The function to call in the child.
    """
    prctl = _prctl()

    def apply() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if parent is not None and os.getppid() != parent:
            os._exit(1)  # the parent died before the request: nobody would kill us

    return apply


def _exit_with(owner: int) -> None:
    """SIGKILL this process once ``owner`` has exited (a thread waits on its pidfd).

    For ranks started by a fork server, whose parent is that server and not the pool's
    owner: the server outlives the owner as long as any of its children does (each
    holds the pipe the server watches), so a death signal tied to it never comes.
    """

    def watch() -> None:
        try:
            fd = os.pidfd_open(owner)
        except ProcessLookupError:
            pass  # already gone
        except (AttributeError, OSError):  # no pidfd (old kernel): look every half second
            while _running(owner):
                time.sleep(0.5)
        else:
            select.select([fd], [], [])  # readable once the owner has exited
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="distkit-owner-watch", daemon=True).start()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:  # no /proc here
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _init_world(rank: int, size: int, backend: str, store_path: str, timeout: float) -> None:
    import torch.distributed as td

    store = td.FileStore(store_path, size)
    td.init_process_group(
        backend, store=store, rank=rank, world_size=size, timeout=timedelta(seconds=timeout)
    )


def _reset(env: dict[str, str]) -> None:
    """Undo what a task may have left behind, so the next task starts clean."""
    os.environ.clear()
    os.environ.update(env)
    from distkit.local import hygiene

    hygiene.reset_state()


def _settle(world: Any, env: dict[str, str], timeout: float) -> Optional[str]:
    """Meet the other ranks after a task, then reset; say why not if that fails.

    Every rank has finished the task when the barrier returns, so destroying the task's
    groups cannot cut a slower rank off while it is still connecting to them. A barrier
    that fails or times out means the world itself is broken (gloo closes a connection
    whose collective timed out, and the next task would fail on it).

    Returns:
        ``None`` when the world is healthy and reset, else what went wrong.
    """
    import torch.distributed as td

    from distkit import _registry

    if _registry.current._default_pg is not world:
        return "the task destroyed or replaced the default process group"
    try:
        if td.get_backend(world) == "gloo":  # a barrier with a timeout of its own
            td.monitored_barrier(world, timeout=timedelta(seconds=timeout))
        else:
            td.barrier(world)  # the parent's own deadline bounds this one
    except Exception as exc:
        return f"the ranks could not meet after the task: {exc}"
    try:
        _reset(env)
    except Exception as exc:
        return f"the reset after the task failed: {exc!r}"
    return None


def _run_task(rank: int, fn: Any, args: tuple, kwargs: dict) -> tuple:
    """Run one task; return ``(kind, value, output)`` ready to send to the parent."""
    out = io.StringIO()
    try:
        if isinstance(fn, FnRef):
            fn = fn.resolve()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            result = fn(*args, **kwargs)
        reply: tuple = ("ok", result, out.getvalue())
        try:
            pickle.dumps(reply)
        except Exception as exc:
            raise TypeError(f"the task's return value cannot be pickled: {exc}") from exc
    except BaseException as exc:  # report everything, SystemExit included
        try:
            exc_bytes: Optional[bytes] = pickle.dumps(exc)
        except Exception:
            exc_bytes = None
        # start at the task's own frames: this function's frame is the same in every report
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        failure = Failure(rank, type(exc).__name__, str(exc), text, exc_bytes)
        reply = ("error", failure, out.getvalue())
    return reply


def _set_device(rank: int, backend: str) -> None:
    """One accelerator per rank, for accelerator backends (nccl: cuda:rank)."""
    from distkit.utils.device import BACKEND_DEVICES

    device_type = BACKEND_DEVICES.get(backend.split(":")[-1], "cpu")
    if device_type != "cpu":
        import torch

        module = getattr(torch, device_type)
        module.set_device(rank % module.device_count())


def _raiser(exc: BaseException) -> Any:
    def fail() -> None:
        raise exc

    return fail


def _one_thread() -> None:
    """One intra-op thread per rank, as torchrun and ``distkit launch`` give: N ranks share
    this machine's cores, and N full thread pools oversubscribe them (a 1 MiB
    ``torch.cat`` took 9 ms instead of 0.2 ms on 2 ranks of 2 cores). Set
    ``OMP_NUM_THREADS`` (in ``env`` or this process's environment) to choose otherwise."""
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def main(
    rank: int,
    size: int,
    backend: str,
    store_path: str,
    stack_path: str,
    conn: Any,
    pg_timeout: float,
    env: dict[str, str],
    first_task: Optional[tuple] = None,
    owner: Optional[int] = None,
) -> None:
    # No orphans: die with the parent, and with the pool's owner when that is another
    # process (a fork server); a parent that died before this line is caught here too.
    direct = owner is not None and os.getppid() == owner
    die_with_parent(owner if direct else None)()
    if owner is not None and not direct:
        _exit_with(owner)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(env)
    if size > 1 and "OMP_NUM_THREADS" not in os.environ:
        _one_thread()
    stack_file = open(stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        _set_device(rank, backend)
        _init_world(rank, size, backend, store_path, pg_timeout)
    except Exception:
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    from distkit import _registry

    world = _registry.current._default_pg
    baseline_env = dict(os.environ)
    while True:
        if first_task is not None:
            task_id, fn, args, kwargs = first_task
            first_task = None
        else:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            if message[0] == "stop":
                break
            if message[0] == "settle":
                conn.send(("settled", _settle(world, baseline_env, message[1])))
                continue
            _, task_id, payload = message
            try:
                fn, args, kwargs, path = pickle.loads(payload)
                sys.path[:] = path
            except BaseException as exc:
                fn, args, kwargs = _raiser(exc), (), {}
        kind, value, output = _run_task(rank, fn, args, kwargs)
        intact = _registry.current._default_pg is world and world is not None
        if intact:  # a group the task broke (a caught timeout) leaves ranks out of step
            from distkit.dist.core.comm import broken_groups

            intact = not broken_groups()
        conn.send((kind, task_id, value, output, intact))
    with contextlib.suppress(Exception):
        import torch.distributed as td

        if _registry.current._default_pg is not None:
            td.destroy_process_group()
