"""Running example scripts and launchers in subprocesses, with timeouts."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from conftest import ROOT


def script_env(**extra: str) -> dict[str, str]:
    """The current environment minus launcher variables, with distkit importable."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            (
                "RANK",
                "WORLD_SIZE",
                "LOCAL_",
                "MASTER_",
                "SLURM_",
                "OMPI_",
                "PMI_",
                "TORCHELASTIC",
                "PYTEST_",
            )
        )
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def run(args: list[str], timeout: float = 180, **extra: str) -> subprocess.CompletedProcess:
    """Run ``args`` (a ``python`` command when it starts with ``-m`` or a path)."""
    cmd = [sys.executable, *args]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=script_env(**extra), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (
        f"{' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n"
        f"--- stderr\n{proc.stderr}"
    )
    return proc


def torchrun(nproc: int, *args: str, timeout: float = 180, **extra: str):
    """``torchrun --standalone --nproc-per-node N``: a free port, never a fixed one."""
    return run(
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args],
        timeout=timeout,
        **extra,
    )


def free_port() -> int:
    """A port the system just handed out (not a fixed one two runs could share)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], **extra: str) -> subprocess.Popen:
    """Start ``python args...`` in the background (output captured)."""
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env=script_env(**extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 180) -> str:
    """Wait for a background process; fail the test with its output if it failed."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"exited {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"
    return out


def alive(pid: int) -> bool:
    """Whether a process is running (a zombie does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


#: Environment variable that tags every process a test starts (children inherit it).
MARK = "DISTKIT_TEST_MARK"


def marked(mark: str, besides: tuple[int, ...] = ()) -> list[int]:
    """Running processes (zombies excluded) started with ``DISTKIT_TEST_MARK=mark``.

    Children inherit the variable, so this finds a launcher's ranks even once they have
    been re-parented (their parent died), which is how orphans are caught.
    """
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in besides:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:  # gone, or not ours
            continue
        if needle in env and alive(int(entry)):
            found.append(int(entry))
    return found


def wait_for(predicate, timeout: float, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds passed; return it."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
