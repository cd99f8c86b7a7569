"""A per-process watchdog thread: signals end a rank even while it is blocked in a transfer, and a stalled wait is
reported, naming the stage and what it waits for.

Why a thread. CPython runs a Python signal handler only when the main thread returns to the interpreter. A rank
blocked in a collective or a receive (gloo's ``Work.wait()``) never does, so the SIGTERM handler Lightning installs
(which forwards the signal to the launched ranks and lets the loop stop at the next batch) never runs; and since a
Python handler replaced the default action, the signal does nothing at all. The C-level handler does run at once,
and writes the signal number to the file descriptor given to :func:`signal.set_wakeup_fd`. The watchdog thread
blocks on that descriptor (a blocked transfer releases the GIL, so the thread runs) and:

1. forwards SIGTERM/SIGINT to the ranks this process launched (Lightning's SIGTERM handler would do so for
   SIGTERM);
2. says on stderr what the rank was waiting for;
3. if the process has not ended by itself within :data:`SIGNAL_GRACE_S` seconds (Lightning's own path, which stops
   at the next batch and may save a SLURM requeue checkpoint, gets that long when the main thread is responsive),
   dumps every thread's stack, kills the launched ranks and exits with ``128 + signal``.

Any rank that ends makes the others end: Lightning's launcher kills every rank when one exits non-zero, and gloo
fails the peers' pending transfers when a process goes away.

The same thread watches the waits the pipeline declares with :func:`waiting` (the stage-shape exchange, each
schedule step's transfers, the log broadcast from the last stage, the pipeline's small collectives): a wait longer
than the strategy's ``stall_timeout`` is reported once on stderr, naming this rank's stage, the rank it waits on and
what for, with the main thread's stack. The job itself fails when the process group's ``timeout`` runs out.

The wakeup descriptor is one slot per process: a previous owner (asyncio) keeps receiving every signal byte, and
gets its slot back when the watchdog stops.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    import subprocess

log = logging.getLogger(__name__)

#: Seconds a signalled rank is given to end by itself before the watchdog ends it. SLURM waits ``KillWait`` (30 s by
#: default) between SIGTERM and SIGKILL; this leaves room for the other ranks to follow.
SIGNAL_GRACE_S = 10.0
_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_POLL_S = 0.25


class Watchdog:
    """See the module docstring. Start and stop it from the main thread.

    Args:
        rank: the global rank, for the messages.
        children: the launched processes (``subprocess.Popen``) to forward a signal to and to kill on exit.
        stall_after: seconds after which a declared wait is reported; ``None``: never.
        grace: seconds a signalled process has to end by itself.
    """

    def __init__(
        self,
        rank: int,
        children: Callable[[], list[subprocess.Popen]] = list,
        stall_after: Optional[float] = None,
        grace: float = SIGNAL_GRACE_S,
    ) -> None:
        self.rank = rank
        self.children = children
        self.stall_after = stall_after
        self.grace = grace
        self._what: Optional[str] = None
        self._since = 0.0
        self._reported = False
        self._signalled_at: Optional[float] = None
        self._signum = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._old_fd = -1
        self._sockets: Optional[tuple[socket.socket, socket.socket]] = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> bool:
        """Start watching; returns ``False`` (and does nothing) off the main thread, where signals cannot be
        watched."""
        if self._thread is not None:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        self._old_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._sockets = (reader, writer)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="lightning_pipe-watchdog", daemon=True)
        self._thread.start()
        log.debug("rank %d: watchdog started (stall report after %s s)", self.rank, self.stall_after)
        return True

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        if threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(self._old_fd)
        self._thread.join(timeout=2 * _POLL_S + 1)
        self._thread = None
        if self._sockets is not None:
            for sock in self._sockets:
                sock.close()
            self._sockets = None

    @contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """Declare that the main thread waits for ``what`` (a phrase: "the output shape of stage 0 from pipeline
        rank 0") until the block ends."""
        previous = (self._what, self._since, self._reported)
        self._what, self._since, self._reported = what, time.monotonic(), False
        try:
            yield
        finally:
            self._what, self._since, self._reported = previous

    # ------------------------------------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception as err:  # the thread must outlive anything that goes wrong in one round
                log.debug("watchdog: %r", err)
                time.sleep(_POLL_S)

    def _tick(self) -> None:
        assert self._sockets is not None
        reader = self._sockets[0]
        ready, _, _ = select.select([reader], [], [], _POLL_S)
        if ready:
            try:
                data = reader.recv(64)
            except (BlockingIOError, OSError):
                data = b""
            for signum in data:
                if self._old_fd != -1:  # whoever had the wakeup descriptor before keeps being told
                    try:
                        os.write(self._old_fd, bytes([signum]))
                    except OSError:
                        pass
                if signum in _SIGNALS and self._signalled_at is None:
                    self._on_signal(signum)
        now = time.monotonic()
        if self._signalled_at is not None and now - self._signalled_at > self.grace:
            name = signal.Signals(self._signum).name
            self._exit(f"did not end within {self.grace:.0f} s of {name}", 128 + self._signum)
        what, since = self._what, self._since
        if what is not None and self.stall_after is not None and not self._reported:
            waited = now - since
            if waited > self.stall_after:
                self._reported = True
                self._say(
                    f"has waited {waited:.0f} s for {what}. The rank it waits on may have failed, or be stuck or"
                    " waiting itself: see its output. The job fails when the process group's `timeout` runs out"
                    " (PipelineStrategy(timeout=...)). Where this rank waits:\n" + _main_stack()
                )

    def _on_signal(self, signum: int) -> None:
        self._signalled_at, self._signum = time.monotonic(), signum
        procs = [p for p in self.children() if p.poll() is None]
        for proc in procs:
            try:
                proc.send_signal(signum)
            except OSError:
                pass
        what = f" while waiting for {self._what}" if self._what else ""
        forwarded = f"; forwarded it to {len(procs)} launched rank(s)" if procs else ""
        self._say(
            f"received {signal.Signals(signum).name}{what}{forwarded}; ending this process in {self.grace:.0f} s"
            " unless the run ends first."
        )

    def _exit(self, why: str, code: int) -> None:
        try:
            self._say(why + "; exiting now. Stacks:")
            faulthandler.dump_traceback(file=2, all_threads=True)  # the process's stderr, whatever replaced sys.stderr
            for proc in self.children():
                try:
                    proc.kill()
                except OSError:
                    pass
        finally:
            os._exit(code)

    def _say(self, text: str) -> None:
        try:
            sys.stderr.write(f"[lightning_pipe rank {self.rank}] {text}\n")
            sys.stderr.flush()
        except (OSError, ValueError):  # a closed or replaced stderr
            os.write(2, f"[lightning_pipe rank {self.rank}] {text}\n".encode(errors="replace"))


def _main_stack() -> str:
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    return "".join(traceback.format_stack(frame)[-6:]) if frame is not None else "(no stack)\n"


# ---------------------------------------------------------------------------------------------- the process's one
_active: Optional[Watchdog] = None


def start(rank: int, children: Callable[[], list[subprocess.Popen]], stall_after: Optional[float]) -> None:
    """Start the process's watchdog (once; later calls update what it reports)."""
    global _active
    if _active is None:
        watchdog = Watchdog(rank, children, stall_after)
        if watchdog.start():
            _active = watchdog
    else:
        _active.rank, _active.children, _active.stall_after = rank, children, stall_after


def stop() -> None:
    global _active
    if _active is not None:
        _active.stop()
        _active = None


@contextmanager
def waiting(what: Callable[[], str]) -> Iterator[None]:
    """Declare a wait for the process's watchdog; ``what`` is called only when a watchdog runs."""
    if _active is None:
        yield
        return
    with _active.waiting(what()):
        yield
