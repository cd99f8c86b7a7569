"""The job's processes: the ranks that rank 0 launched, and ending those when it fails (the mesh that groups them is
:mod:`lightning_pipe._lightning.parallel_dims`'s)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import torch
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from lightning_pipe._compat.lightning import init_process_group

if TYPE_CHECKING:
    from lightning.fabric.plugins.environments import ClusterEnvironment

#: How long a failing rank 0 gives the ranks it launched to fail on their own (and say why) before it ends them.
GRACE_S = 3.0


def launched_processes(launcher: object) -> list[subprocess.Popen]:
    """The processes (``subprocess.Popen``) Lightning's launcher started from this one: the other ranks on rank 0 of a
    job started as one script, else none."""
    if isinstance(launcher, _SubprocessScriptLauncher):
        return list(launcher.procs)
    return []


def end_launched_processes(launcher: Any, exception: BaseException, rank: int) -> None:
    """After ``exception`` on the rank that launched the others: they may wait on it in a transfer. Give them a moment
    to fail on their own (and print why), then end them so that no process is left hanging."""
    procs = launched_processes(launcher)
    if not procs:
        return
    # Say why now: when a launched rank has failed too, Lightning's observer thread SIGKILLs this process as well,
    # possibly before Python prints the traceback.
    text = "".join(traceback.format_exception_only(type(exception), exception)).rstrip()
    sys.stderr.write(f"[rank {rank}] {text}\n")
    sys.stderr.flush()
    deadline = time.monotonic() + GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    launcher.kill(signal.SIGKILL)


def start_process_group(
    cluster_environment: ClusterEnvironment, backend: Optional[str], timeout: Optional[timedelta], device: torch.device
) -> str:
    """Reset the seed as Lightning's strategies do, and start the default process group with ``backend`` (``None``:
    Lightning's default for ``device``); returns the backend."""
    reset_seed()
    backend = backend or _get_default_process_group_backend_for_device(device)
    init_process_group(cluster_environment, backend, timeout, device)
    return backend
