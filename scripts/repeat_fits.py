"""Run N short 2-process fits one after another and report every rank's exit code.

Usage:
    python scripts/repeat_fits.py [-n 50] [--strategy pipeline|ddp] [--steps 3]
        [--taskset 0 --renice-gloo 19]   # the amplifier used in the notes (issue12.md, part 1)
        [--parallel K] [--switch-interval S] [--delay-recv S] [--gdb | --gdb1] [--timeout 120] [--show LINES]

``LP_CHECKOUT`` (default: this checkout) is where ``lightning_pipe`` and ``tests/models.py`` (TinyLM) are imported
from.
Exit status: 0 when every run exited 0 on both ranks.

Each fit is ``python repeat_fits.py --child ...`` started in its own session. Rank 0 is that process; Lightning's
``_SubprocessScriptLauncher`` starts rank 1 as rank 0's child, so rank 1's exit code is never seen by the caller
(rank 0 does not wait for it, and rank 1 may outlive rank 0). To surface it, the child command of the launcher is
wrapped in ``sh -c 'python ...; echo __RANK1_RC=$? >&2'``: the shell only waits and reports, so rank 1 runs exactly
as it would otherwise. The run's combined stdout+stderr is captured until every process of the session has closed
it, and searched for "terminate called" (the C++ std::terminate message that precedes SIGABRT, exit 134).

Nothing runs after ``trainer.fit`` in the child: even a print there releases the GIL and hides the race.
Amplifier: ``--taskset 0`` puts both ranks on CPU 0 and ``--renice-gloo 19`` gives gloo's threads nice 19 at
``on_train_start``, so they run late as on a loaded machine; it widens exactly the window of the exit race.

Not part of the timed test suite: 50 fits take 8-10 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import collections
import os
import shlex
import subprocess
import sys
import time

_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(args: argparse.Namespace) -> None:
    import lightning as L
    import lightning.pytorch.strategies.launchers.subprocess_script as sps
    import torch

    base = sps._basic_subprocess_cmd

    def wrapped() -> list[str]:  # report rank 1's exit status on stderr (see the module docstring)
        cmd = base()
        if args.gdb1:  # rank 1 under gdb: print the stacks of a crash, and "__RANK1_RC=134" for it
            gdb = ["gdb", "-q", "-batch", "-ex", "run", "-ex", "bt 40", "-ex", "thread apply all bt 8", "--args"]
            return ["sh", "-c", f"{shlex.join(gdb + cmd)} 2>&1 | tee /dev/stderr | grep -q SIGABRT"
                                f" && echo __RANK1_RC=134 >&2 || echo __RANK1_RC=0 >&2"]
        return ["sh", "-c", f"{shlex.join(cmd)}; echo __RANK1_RC=$? >&2"]

    sps._basic_subprocess_cmd = wrapped

    checkout = os.environ.get("LP_CHECKOUT", _CHECKOUT)
    sys.path[:0] = [checkout, os.path.join(checkout, "tests")]
    import models  # tests/models.py: TinyLM and its token data

    from lightning_pipe import PipelineStrategy

    if args.switch_interval:  # amplifier: a gloo thread waiting for the GIL waits this long at most
        sys.setswitchinterval(args.switch_interval)
    strategy = PipelineStrategy(num_microbatches=2) if args.strategy == "pipeline" else "ddp"
    if args.delay_recv:  # fault injection: rank 0 takes the last step's log broadcast late
        from lightning_pipe._lightning.log import LogChannel

        share = LogChannel.share

        def late_share(self, payload):
            if payload is None and _trainer.global_step == args.steps - 1:
                time.sleep(args.delay_recv)
            return share(self, payload)

        LogChannel.share = late_share
    torch.manual_seed(0)
    model = models.TinyLM(blocks=4)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    global _trainer
    _trainer = trainer
    if args.renice_gloo:  # amplifier: gloo's worker threads run late, as on a loaded machine
        class Renice(L.Callback):
            def on_train_start(self, trainer, pl_module):
                for tid in os.listdir("/proc/self/task"):
                    with open(f"/proc/self/task/{tid}/comm") as f:
                        if f.read().strip() in ("pt_gloo_runloop", "gloo_tcp_loop"):
                            os.setpriority(os.PRIO_PROCESS, int(tid), args.renice_gloo)

        trainer.callbacks.append(Renice())
    trainer.fit(model, models.loader(n=64, batch_size=8))
    # Nothing after `fit`, as in a user's script: even a print would release the GIL and hide the race (see notes).


def parent(args: argparse.Namespace) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED"):
        env.pop(var, None)
    counts: collections.Counter = collections.Counter()
    bad = 0
    t0 = time.time()
    def start(i: int) -> tuple:
        gdb = ["gdb", "-q", "-batch", "-ex", "run", "-ex", "bt 30", "-ex", "info threads", "--args"] if args.gdb else []
        cmd = (["taskset", "-c", args.taskset] if args.taskset else []) + gdb + [
            sys.executable, os.path.abspath(__file__), "--child", "--strategy", args.strategy, "--steps",
            str(args.steps), "--delay-recv", str(args.delay_recv), "--switch-interval", str(args.switch_interval),
            "--renice-gloo", str(args.renice_gloo)] + (["--gdb1"] if args.gdb1 else [])
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        return i, proc, time.time()

    def finish(i: int, proc: subprocess.Popen, start: float) -> bool:
        try:
            out, _ = proc.communicate(timeout=max(1.0, args.timeout - (time.time() - start)))
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, _ = proc.communicate()
            timed_out = True
        rc0 = proc.returncode
        if args.gdb:  # gdb exits 0 either way: read the outcome from its output
            rc0 = -6 if "SIGABRT" in out else (0 if "exited normally" in out else rc0)
        rc1 = None
        for line in out.splitlines():
            if line.startswith("__RANK1_RC="):
                rc1 = int(line.split("=")[1])
        done = out.count("`max_steps=")  # rank 0's "`Trainer.fit` stopped: `max_steps=3` reached."
        terminate = out.count("terminate called")
        ok = rc0 == 0 and rc1 == 0 and done == 1 and not terminate and not timed_out
        counts[(rc0, rc1)] += 1
        print(f"run {i + 1:3d}: rank0 rc={rc0} rank1 rc={rc1} fit_done={done} 'terminate called' x{terminate}"
              f"{' TIMEOUT' if timed_out else ''} {time.time() - start:.1f}s{'' if ok else '  <-- FAIL'}", flush=True)
        if not ok and args.show:
            print("\n".join("    | " + line for line in out.splitlines()[-args.show:]), flush=True)
        return ok

    i = 0
    while i < args.n:  # `--parallel K`: K fits at a time (contention widens the race); default one at a time
        batch = [start(j) for j in range(i, min(args.n, i + args.parallel))]
        bad += sum(not finish(*job) for job in batch)
        i += len(batch)
    print(f"\n{args.strategy}: {args.n - bad} of {args.n} runs exited 0 on both ranks ({time.time() - t0:.0f}s)")
    print("exit codes (rank0, rank1):", dict(counts))
    sys.exit(1 if bad else 0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", action="store_true")
    p.add_argument("-n", type=int, default=50)
    p.add_argument("--strategy", choices=("pipeline", "ddp"), default="pipeline")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--delay-recv", type=float, default=0.0,
                   help="fault injection: rank 0 receives the last step's log broadcast this many seconds late")
    p.add_argument("--taskset", default="", help="run every rank on these CPUs (e.g. 0): contention widens the race")
    p.add_argument("--switch-interval", type=float, default=0.0,
                   help="amplifier: sys.setswitchinterval in every rank (default: Python's 0.005 s)")
    p.add_argument("--renice-gloo", type=int, default=0,
                   help="amplifier: nice value for gloo's threads (e.g. 19; use with --taskset 0)")
    p.add_argument("--parallel", type=int, default=1, help="fits run at the same time")
    p.add_argument("--gdb1", action="store_true", help="run rank 1 under gdb and print the stacks of a crash")
    p.add_argument("--gdb", action="store_true", help="run rank 0 under gdb and print the stack of a crash")
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--show", type=int, default=15, help="lines of output to show for a failed run")
    args = p.parse_args()
    child(args) if args.child else parent(args)


if __name__ == "__main__":
    main()
