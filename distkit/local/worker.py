"""The loop each rank process of a :class:`~distkit.local.pool.RankPool` runs.

A worker joins a gloo world through a FileStore (no ports), then runs the tasks the
parent sends, one at a time, and answers each with its result or its traceback. Between
tasks it puts back what a task may have changed (environment variables, distkit
settings, cached groups). If the parent goes away, so does the worker.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import io
import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional


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


def _set_parent_death_signal() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no orphans)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


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
        failure = Failure(rank, type(exc).__name__, str(exc), traceback.format_exc(), exc_bytes)
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
) -> None:
    _set_parent_death_signal()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(env)
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
    task_id = 0
    while True:
        if first_task is not None:
            fn, args, kwargs = first_task
            first_task = None
        else:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            if message[0] == "stop":
                break
            _, task_id, payload = message
            try:
                fn, args, kwargs, path = pickle.loads(payload)
                sys.path[:] = path
            except BaseException as exc:
                fn, args, kwargs = _raiser(exc), (), {}
        kind, value, output = _run_task(rank, fn, args, kwargs)
        intact = _registry.current._default_pg is world and world is not None
        try:
            if intact:
                _reset(baseline_env)
        except Exception:
            intact = False
        conn.send((kind, task_id, value, output, intact))
    with contextlib.suppress(Exception):
        import torch.distributed as td

        if _registry.current._default_pg is not None:
            td.destroy_process_group()
