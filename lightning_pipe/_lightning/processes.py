"""The job's processes: the ranks that rank 0 launched, and ending those when it fails (the mesh that groups them is
:mod:`lightning_pipe._parallel_dims`'s)."""

from __future__ import annotations

import json
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

from lightning_pipe import _watchdog
from lightning_pipe._compat.lightning import init_process_group
from lightning_pipe._compat.torch import job_store

if TYPE_CHECKING:
    from lightning.fabric.plugins.environments import ClusterEnvironment

#: How long a failing rank 0 gives the ranks it launched to fail on their own (and say why) before it ends them.
GRACE_S = 3.0
#: Where a failing rank leaves its error in the job's store ([Note: the first failure, named]).
FAILED_KEY = "lightning_pipe/failed/"


def launched_processes(launcher: object) -> list[subprocess.Popen]:
    """The processes (``subprocess.Popen``) Lightning's launcher started from this one: the other ranks on rank 0 of a
    job started as one script, else none."""
    if isinstance(launcher, _SubprocessScriptLauncher):
        return list(launcher.procs)
    return []


def start_watchdog(rank: int, launcher: Any, stall_timeout: Optional[float]) -> None:
    """Start this rank's watchdog (signals end the rank even in a transfer; a stalled wait is reported), which knows
    the ranks this one launched."""
    _watchdog.start(rank, lambda: launched_processes(launcher), stall_timeout)


def record_failure(exception: BaseException, rank: int) -> Optional[float]:
    """Leave ``exception`` in the job's store under this rank, with when it happened ([Note: the first failure,
    named]); returns that time, or ``None`` without a store."""
    store = job_store()
    if store is None:
        return None
    when = time.time()
    text = "".join(traceback.format_exception_only(type(exception), exception)).strip()
    try:
        store.set(f"{FAILED_KEY}{rank}", json.dumps({"time": when, "error": text[-2000:]}))
    except Exception:  # the store's server went with a failed rank 0: nothing to tell
        return None
    return when


def forget_failure(rank: int) -> None:
    """A Trainer call starts: an error this rank left in an earlier call (which a script caught) is no cause of the
    failures of this one."""
    store = job_store()
    if store is not None:
        try:
            store.delete_key(f"{FAILED_KEY}{rank}")
        except Exception:  # a store without deletion: a stale error is named only if it is older than the failure
            pass


def name_first_failure(exception: BaseException, rank: int, world_size: int) -> None:
    """[Note: the first failure, named] When one rank fails, the others fail after it in a transfer or a collective
    with the process group's own words ("Connection closed by peer"), which name neither the rank nor the cause.
    Each failing rank leaves its error in the job's store (:func:`record_failure`); then one whose own error is such a
    consequence looks, for up to :data:`GRACE_S`, for a rank that failed before it, and adds that rank and its
    exception to its own exception as a note: rank 0's traceback, the one users read, names the failing rank and what
    it raised. A rank whose error is its own (the user's code, a refusal) only looks once, without waiting."""
    since = record_failure(exception, rank)
    store = job_store()
    if since is None or store is None or world_size < 2:
        return
    wait = GRACE_S if _after_a_peer(exception) else 0.0
    keys = [f"{FAILED_KEY}{r}" for r in range(world_size) if r != rank]
    deadline = time.monotonic() + wait
    first: Optional[tuple[float, int, str]] = None
    while first is None:
        try:
            for key in keys:
                if store.check([key]):
                    record = json.loads(store.get(key))
                    if record["time"] <= since and (first is None or record["time"] < first[0]):
                        first = (record["time"], int(key.rsplit("/", 1)[1]), record["error"])
        except Exception:  # the store went with the rank that served it: the error stays as it is
            return
        if first is not None or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if first is None:
        return
    note = f"[lightning_pipe] rank {first[1]} failed first, and this rank failed after it: {first[2]}"
    if hasattr(exception, "add_note"):
        exception.add_note(note)
    elif exception.args and isinstance(exception.args[0], str):  # Python 3.10: no notes
        exception.args = (f"{exception.args[0]}\n{note}", *exception.args[1:])


def fail(exception: BaseException, launcher: Any, rank: int, world_size: int) -> None:
    """This rank failed with ``exception``: name the rank that failed first ([Note: the first failure, named]), then,
    on the rank that launched the others, end them."""
    name_first_failure(exception, rank, world_size)
    end_launched_processes(launcher, exception, rank)


def _after_a_peer(exception: BaseException) -> bool:
    """Whether ``exception`` is what a rank raises when another one failed: the process group's own error."""
    import torch.distributed as dist

    if isinstance(exception, (dist.DistError, dist.DistBackendError)):
        return True
    text = str(exception)
    return isinstance(exception, RuntimeError) and any(
        words in text for words in ("Connection closed by peer", "Connection reset by peer", "gloo", "NCCL")
    )


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
