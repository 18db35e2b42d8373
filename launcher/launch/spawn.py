"""The one function that starts processes: runs the launch command, relays the ranks' output, draws
a progress bar from rank 0's metrics.jsonl, and watches the ranks until they end.

What it does when things go wrong:

- A rank fails (an error, or killed): horovodrun, mpirun and srun (--kill-on-bad-exit) end the
  other ranks themselves within seconds. If a rank's process on this host is gone and the launch
  command is still running `RANK_EXIT_GRACE_S` later (the others blocked in a collective that can
  never complete), the launcher kills every process of the launch itself. Either way it prints which rank failed, how
  (exit status or signal) and the last lines that rank printed, and returns `EXIT_RANK_FAILED`.
- Ctrl-C or SIGTERM to the launcher: it passes the signal on to the rank processes on this host (to
  the launch command when it sees none), which makes every rank stop after the same step and rank 0
  save a checkpoint (launcher/rank/stop.py); srun gets SIGTERM for either, since one SIGINT only makes
  it print its tasks' states. Ranks still running `STOP_GRACE_S` later, or after a second Ctrl-C
  or SIGTERM, are killed. Returns 128 + the signal number (130 for Ctrl-C, 143 for SIGTERM).

The launch command runs in its own session, so a Ctrl-C on the terminal reaches the launcher alone
and the stop is the launcher's to run; it also gets SIGTERM if the launcher itself dies.
"""
from __future__ import annotations

import collections
import ctypes
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import psutil

from launcher import env as ev
from lms_core.units import format_bytes

EXIT_RANK_FAILED = 1
STOPPED_STATUSES = (128 + signal.SIGINT, 128 + signal.SIGTERM)  # 130 after Ctrl-C, 143 after SIGTERM
# How ranks end when asked to stop: by the signal itself, or killed once the grace period is over
# (horovodrun kills what is still running 5 s after it sees a rank leave). Anything else is a failure.
STOP_TEARDOWN_STATUSES = (*STOPPED_STATUSES, 128 + signal.SIGKILL)

POLL_S = 0.2
STOP_GRACE_S = 60.0  # after asking the ranks to stop: time to finish the step and write a checkpoint
RANK_EXIT_GRACE_S = 10.0  # after a rank process ended mid-run: time for horovodrun or mpirun to end the rest
KILL_WAIT_S = 5.0
TAIL_LINES = 20
WORKER_MODULE = "launcher.worker"

# How horovodrun and `mpirun --tag-output` mark each line of a rank: `[1]<stderr>:` and `[1,1]<stderr>:`
# (Open MPI puts the job id first).
_RANK_TAG = re.compile(r"\[(?:\d+,)?(\d+)\]<(?:stdout|stderr)>:")
# How they report a rank that ended badly (Horovod 0.28.1 is the last release; Open MPI 4.x).
_HOROVODRUN_EXIT = re.compile(r"^Process (\d+) exit with status code (-?\d+)\.")
_MPIRUN_SIGNAL = re.compile(r"mpirun noticed that process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)")
_MPIRUN_PROCESS = re.compile(r"Process name:\s+\[\[\d+,\d+\],(\d+)\]")
_MPIRUN_EXIT_CODE = re.compile(r"Exit code:\s+(-?\d+)")
# srun --label marks each line with its task (`1: `, padded to the widest task number), and reports a
# task that ended badly as `srun: error: node2: task 1: Killed` (the signal's description, strsignal's
# words) or `...: tasks 0-1: Exited with exit code 3` (Slurm 22.05).
_SRUN_LABEL = re.compile(r"^\s*(\d+): ")
_SRUN_EXIT = re.compile(r"^srun: error: \S+: tasks? ([\d,\-]+): (.+)$")
_SRUN_EXIT_CODE = re.compile(r"^Exited with exit code (\d+)$")
_SRUN_NODE_FAILURE = re.compile(r"^srun: error: Node failure on (\S+)")  # Slurm declared the node lost
_SIGNAL_WORDS = {signal.strsignal(sig): int(sig) for sig in signal.Signals if signal.strsignal(sig)}
_TRACEBACK = "Traceback (most recent call last):"
# What a rank prints when it failed because another rank ended first (Horovod 0.28.1's words).
_CONSEQUENCES = ("Horovod has been shut down",)
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RankExit:
    """A rank that ended with a non-zero status, as the launch command or this launcher saw it."""

    rank: int
    status: int | None  # exit status (128 + N when ended by signal N); None when unknown
    signal: int | None = None
    raised: bool = False  # it printed a Python traceback before it ended

    def describe(self) -> str:
        if self.raised:
            return f"rank {self.rank} failed with an error"
        sig = self.signal
        if sig is None and self.status is not None and 128 < self.status < 128 + 65:
            sig = self.status - 128
        if sig is not None:
            try:
                name = signal.Signals(sig).name
            except ValueError:
                name = f"signal {sig}"
            return f"rank {self.rank} was ended by signal {sig} ({name})"
        if self.status is None:
            return f"rank {self.rank}'s process ended while the others were still running"
        return f"rank {self.rank} exited with status {self.status}"


class RankOutput:
    """The output of the launch, line by line: which rank printed each line, the last `TAIL_LINES`
    of each rank, the ranks that the launch command reported as ended with a non-zero status, and
    the order in which ranks first showed trouble (a traceback, or that report)."""

    def __init__(self, single_rank: bool, srun: bool = False):
        self.single_rank = single_rank  # the worker runs directly: every line is rank 0's
        self.srun = srun  # srun marks rank lines its own way
        self.tails: dict[int, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=TAIL_LINES))
        self.exits: list[RankExit] = []
        self.trouble: list[int] = []  # ranks, in the order of their first traceback or bad exit
        self.raised: set[int] = set()
        self.lost_nodes: list[str] = []  # nodes the launch command reported lost (srun)
        self._mpi_process: int | None = None
        self._lock = threading.Lock()

    def feed(self, line: str) -> None:
        with self._lock:
            if self.single_rank:
                self._rank_line(0, line)
                return
            if self.srun and (label := _SRUN_LABEL.match(line)):
                self._rank_line(int(label.group(1)), line[label.end():])
                return
            tag = _RANK_TAG.match(line)
            if tag:
                # mpirun tags every write, and one line may hold several: keep the text only.
                self._rank_line(int(tag.group(1)), _RANK_TAG.sub("", line))
                return
            self._parse_launcher_line(line)

    def _rank_line(self, rank: int, text: str) -> None:
        self.tails[rank].append(text)
        if text.startswith(_TRACEBACK):
            self.raised.add(rank)
            self._trouble(rank)

    def _parse_launcher_line(self, line: str) -> None:
        if match := _HOROVODRUN_EXIT.match(line):
            self.add_exit(RankExit(int(match.group(1)), int(match.group(2))))
        elif match := _MPIRUN_SIGNAL.search(line):
            sig = int(match.group(2))
            self.add_exit(RankExit(int(match.group(1)), 128 + sig, sig))
        elif match := _MPIRUN_PROCESS.search(line):
            self._mpi_process = int(match.group(1))
        elif (match := _MPIRUN_EXIT_CODE.search(line)) and self._mpi_process is not None:
            self.add_exit(RankExit(self._mpi_process, int(match.group(1))))
            self._mpi_process = None
        elif match := _SRUN_EXIT.match(line):
            for rank in _task_numbers(match.group(1)):
                self.add_exit(_srun_exit(rank, match.group(2)))
        elif match := _SRUN_NODE_FAILURE.match(line):
            self.lost_nodes.append(match.group(1))

    def add_exit(self, rank_exit: RankExit) -> None:
        if rank_exit.status != 0 and all(e.rank != rank_exit.rank for e in self.exits):
            self.exits.append(rank_exit)
            self._trouble(rank_exit.rank)

    def _trouble(self, rank: int) -> None:
        if rank not in self.trouble:
            self.trouble.append(rank)

    def culprit(self) -> RankExit | None:
        """The rank whose failure ended the run: of the ranks that ended badly, the first to show
        trouble whose error is not a consequence of another rank's end (a rank blocked in a
        collective fails with Horovod's "has been shut down" once its peer is gone; the launch
        command may even see that rank end first)."""
        with self._lock:
            failed = {e.rank: e for e in self.exits}
            candidates = [rank for rank in self.trouble if rank in failed]
            if not candidates:
                return None
            started_it = next((rank for rank in candidates if not any(
                marker in line for line in self.tails.get(rank, ()) for marker in _CONSEQUENCES)), candidates[0])
            return dataclasses.replace(failed[started_it], raised=started_it in self.raised)

    def tail(self, rank: int) -> list[str]:
        with self._lock:
            return list(self.tails.get(rank, ()))


def _task_numbers(text: str) -> list[int]:
    """srun's task list, `3` or `0-1,4`, as task numbers."""
    numbers = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        if low.isdigit() and (not high or high.isdigit()):
            numbers += range(int(low), int(high or low) + 1)
    return numbers


def _srun_exit(rank: int, how: str) -> RankExit:
    """A task's end as srun words it: an exit code, or the signal's description (strsignal)."""
    if match := _SRUN_EXIT_CODE.match(how):
        return RankExit(rank, int(match.group(1)))
    sig = _SIGNAL_WORDS.get(how)
    return RankExit(rank, 128 + sig, sig) if sig else RankExit(rank, None)


class RankProcesses:
    """The rank processes on this host under the launch command (the worker's Python processes,
    told apart from the shells that start them by their argv), each with its rank."""

    def __init__(self, launch: subprocess.Popen, single_rank: bool):
        self.launch = launch
        self.single_rank = single_rank
        self.seen: dict[int, psutil.Process] = {}
        self.gone: dict[int, float] = {}  # rank -> when its process was first seen gone

    def scan(self) -> None:
        try:
            root = psutil.Process(self.launch.pid)
            candidates = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            candidates = []
        for process in candidates:
            rank = self._rank_of(process)
            if rank is not None and rank not in self.seen:
                self.seen[rank] = process
        now = time.monotonic()
        for rank, process in self.seen.items():
            if rank not in self.gone and not _alive(process):
                self.gone[rank] = now

    def _rank_of(self, process: psutil.Process) -> int | None:
        try:
            argv = process.cmdline()
            if WORKER_MODULE not in argv or argv[argv.index(WORKER_MODULE) - 1] != "-m":
                return None
            if self.single_rank:
                return 0
            environ = process.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, ValueError):
            return None
        for key in (ev.HOROVOD_RANK, ev.OMPI_COMM_WORLD_RANK):
            if environ.get(key, "").isdigit():
                return int(environ[key])
        return None

    def alive(self) -> list[psutil.Process]:
        return [p for p in self.seen.values() if _alive(p)]

    def first_gone(self) -> tuple[int, float] | None:
        return min(self.gone.items(), key=lambda item: item[1]) if self.gone else None


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class ProgressBar:
    """A tqdm bar on the launcher's terminal, advanced by the records rank 0 appends to metrics.jsonl.
    Off the terminal (CI, `| tee`) it stays silent: rank 0 prints a line per interval anyway."""

    def __init__(self, metrics_path: Path, total_steps: int, enabled: bool):
        self._path = metrics_path
        self._offset = 0
        self._lock = threading.Lock()
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True, leave=True)

    def write(self, line: str) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.write(line)
            else:
                print(line, flush=True)

    def poll(self) -> None:
        if self._bar is None or not self._path.exists():
            return
        with open(self._path, encoding="utf-8") as f:
            f.seek(self._offset)
            chunk = f.read()
        complete, _, _ = chunk.rpartition("\n")  # leave a half-written last line for the next poll
        if not complete:
            return
        self._offset += len(complete) + 1
        records = [json.loads(line) for line in complete.splitlines() if line.strip()]
        last_step = max(r["step"] for r in records)
        latest = [r for r in records if r["step"] == last_step]
        with self._lock:
            self._bar.update(last_step - self._bar.n)
            self._bar.set_postfix_str(
                f"{sum(r['samples_per_sec'] for r in latest):.1f} samples/s, "
                f"peak {format_bytes(max(r['peak_memory_bytes'] for r in latest))}, loss {latest[0]['loss']:.3f}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class _Signals:
    """Ctrl-C and SIGTERM to the launcher, recorded for the watch loop (which runs the stop)."""

    def __init__(self):
        self.received: list[int] = []
        self._previous = {}

    def __enter__(self) -> "_Signals":
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, lambda signum, frame: self.received.append(signum))
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _find_prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


# Looked up here, not in the forked child, where a loader lock held by another thread could hang it.
_PRCTL = _find_prctl()


def _die_with_parent() -> None:
    """In the launch command's process, between fork and exec: SIGTERM when the launcher dies (even
    by SIGKILL), so no launch outlives the launcher that watches it. Linux only; elsewhere a no-op."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def kill_all(launch: subprocess.Popen, ranks: RankProcesses) -> None:
    """SIGKILL to the launch command, everything under it and every rank process seen."""
    try:
        victims = psutil.Process(launch.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        victims = []
    victims += [p for p in ranks.alive() if p not in victims]
    for process in victims:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        launch.kill()
    except ProcessLookupError:
        pass
    psutil.wait_procs(victims, timeout=KILL_WAIT_S)


def run_ranks(argv: list[str], env_additions: Mapping[str, str], metrics_path: Path, total_steps: int,
              progress: bool = True) -> int:
    """Starts `argv` (the worker, horovodrun or mpirun), relays its output and watches the ranks.
    Returns 0 when every rank succeeded, EXIT_RANK_FAILED when one failed, 128 + N after signal N."""
    env = dict(os.environ)
    env.update(env_additions)
    single_rank = argv[1:3] == ["-m", WORKER_MODULE]
    srun = Path(argv[0]).name == "srun"
    output = RankOutput(single_rank, srun)
    process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, bufsize=1, errors="replace",
                               start_new_session=True, preexec_fn=_die_with_parent)
    bar = ProgressBar(metrics_path, total_steps, enabled=progress and sys.stderr.isatty())

    def relay_output() -> None:
        for line in process.stdout:
            line = line.rstrip("\n")
            output.feed(line)
            bar.write(line)

    relay = threading.Thread(target=relay_output, daemon=True)
    relay.start()
    ranks = RankProcesses(process, single_rank)
    with _Signals() as signals:
        killed_after_rank_exit = _watch(process, ranks, bar, signals, srun)
    relay.join(timeout=5)
    bar.poll()
    bar.close()
    if single_rank and process.returncode != 0:
        output.add_exit(RankExit(0, _shell_status(process.returncode)))
    return _outcome(process, ranks, output, signals, killed_after_rank_exit)


def _watch(process: subprocess.Popen, ranks: "RankProcesses", bar: "ProgressBar", signals: "_Signals",
           srun: bool) -> int | None:
    """Watches the ranks until the launch command ends: a stop asked for is passed on (and the ranks
    killed when they overstay it or it is asked again), and a rank that died takes the others with it
    after RANK_EXIT_GRACE_S. Returns that rank, when that is how it ended."""
    stop_deadline = None
    killed_after_rank_exit: int | None = None
    while process.poll() is None:
        ranks.scan()
        bar.poll()
        if signals.received and stop_deadline is None:
            stop_deadline = time.monotonic() + STOP_GRACE_S
            _ask_ranks_to_stop(process, ranks, signal.SIGTERM if srun else signals.received[0])
        elif stop_deadline is not None and (len(signals.received) > 1 or time.monotonic() > stop_deadline):
            why = ("asked again" if len(signals.received) > 1
                   else f"still running {STOP_GRACE_S:.0f} s after the request to stop")
            print(f"lms-launch: killing the ranks ({why})", file=sys.stderr, flush=True)
            kill_all(process, ranks)
            break
        elif (stop_deadline is None and (first := ranks.first_gone())
              and time.monotonic() - first[1] > RANK_EXIT_GRACE_S):
            killed_after_rank_exit = first[0]
            kill_all(process, ranks)
            break
        time.sleep(POLL_S)
    process.wait()
    if ranks.alive():  # a rank the launch command left behind: no process outlives the launch
        kill_all(process, ranks)
    return killed_after_rank_exit


def _outcome(process: subprocess.Popen, ranks: "RankProcesses", output: "RankOutput", signals: "_Signals",
             killed_after_rank_exit: int | None) -> int:
    """The launcher's exit status, with the failure named where a rank failed."""
    if process.returncode == 0 and killed_after_rank_exit is None:
        return 0  # every rank finished (a stop asked for after training had no step left to stop at)
    if signals.received:
        status = 128 + signals.received[0]
        failure = _failure_after_signal(output, status)
        if failure is None:
            print(f"lms-launch: the ranks stopped after {signal.Signals(signals.received[0]).name}", file=sys.stderr)
            return status
    elif killed_after_rank_exit is not None:
        failure = RankExit(killed_after_rank_exit, None)
    else:
        failure = _first_failure(output, ranks, process.returncode)
    _report(failure, output, stopped_others=killed_after_rank_exit is not None)
    return EXIT_RANK_FAILED


def _failure_after_signal(output: RankOutput, status: int) -> RankExit | None:
    """The rank to blame after a signal to stop: one that ended otherwise than a stop ends ranks, or,
    where srun reported a node lost, the first rank reported ended. Slurm stops a job whose node was
    lost (SIGTERM to the batch script), and the ranks srun ended for it may have exited as stopped
    ones do (143): the stop is then the node's doing, not the user's. None: the ranks just stopped."""
    failure = next((dataclasses.replace(e, raised=e.rank in output.raised) for e in output.exits
                    if e.status not in STOP_TEARDOWN_STATUSES), None)
    if failure is None and output.lost_nodes:
        return output.exits[0] if output.exits else RankExit(-1, status)
    return failure


def _shell_status(returncode: int) -> int:
    """Popen's -N (ended by signal N) as the shell and the launch commands write it: 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def _ask_ranks_to_stop(process: subprocess.Popen, ranks: RankProcesses, signum: int) -> None:
    ranks.scan()
    local = ranks.alive()
    name = signal.Signals(signum).name
    if local:
        print(f"lms-launch: {name}: the ranks stop together within a step or two (rank 0 saves a checkpoint "
              f"when checkpoint.dir is set); {name} again kills them now", file=sys.stderr, flush=True)
        for rank_process in local:
            try:
                rank_process.send_signal(signum)
            except psutil.NoSuchProcess:
                pass
    else:  # no rank on this host (yet): the launch command passes the signal on to all of them
        print(f"lms-launch: {name}: stopping the launch", file=sys.stderr, flush=True)
        try:
            process.send_signal(signum)
        except ProcessLookupError:
            pass


def _first_failure(output: RankOutput, ranks: RankProcesses, returncode: int) -> RankExit:
    """The rank to blame: from the launch command's reports and the ranks' output, else the rank
    process seen ending first."""
    culprit = output.culprit()
    if culprit is not None:
        return culprit
    first = ranks.first_gone()
    if first is not None:
        return RankExit(first[0], None)
    return RankExit(-1, _shell_status(returncode))


def _report(failure: RankExit, output: RankOutput, stopped_others: bool) -> None:
    for node in output.lost_nodes:  # the cause; the ranks elsewhere failed because its ranks were gone
        print(f"lms-launch: node {node} was lost (srun: Node failure on {node}); its ranks ended with it",
              file=sys.stderr)
    if failure.rank < 0:
        print(f"lms-launch: a rank failed: the launch command exited with status {failure.status} "
              f"and named no rank", file=sys.stderr, flush=True)
        return
    how = "; the launcher killed the other ranks" if stopped_others else ""
    print(f"lms-launch: a rank failed: {failure.describe()}{how}", file=sys.stderr)
    tail = output.tail(failure.rank)
    if tail:
        print(f"lms-launch: last lines of rank {failure.rank}:", file=sys.stderr)
        for line in tail:
            print(f"    {line}", file=sys.stderr)
    else:
        print(f"lms-launch: rank {failure.rank} printed nothing", file=sys.stderr)
    sys.stderr.flush()
