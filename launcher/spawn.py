"""The one function that starts processes: runs the launch command, relays the ranks' output, and
draws a progress bar from rank 0's metrics.jsonl while they train."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Mapping

from launcher.metrics import format_bytes


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


def run_ranks(argv: list[str], env_additions: Mapping[str, str], metrics_path: Path, total_steps: int,
              progress: bool = True) -> int:
    """Starts `argv` (the worker, horovodrun or mpirun) and waits for it; returns its exit status,
    which horovodrun and mpirun make non-zero when any rank fails."""
    env = dict(os.environ)
    env.update(env_additions)
    bar = ProgressBar(metrics_path, total_steps, enabled=progress and sys.stderr.isatty())
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, bufsize=1, errors="replace")

    def relay_output() -> None:
        for line in process.stdout:
            bar.write(line.rstrip("\n"))

    relay = threading.Thread(target=relay_output, daemon=True)
    relay.start()
    try:
        while process.poll() is None:
            bar.poll()
            time.sleep(0.5)
    except KeyboardInterrupt:
        process.terminate()  # horovodrun and mpirun pass it on to every rank
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        relay.join(timeout=5)
        bar.close()
        return 130
    relay.join()
    bar.poll()
    bar.close()
    return process.returncode
