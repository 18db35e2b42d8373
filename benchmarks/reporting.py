"""What the benchmark scripts share to report what they measured: a log that writes each line to the
terminal and to its file as it comes (so a run cut short keeps what it measured), and the GPU's
facts as nvidia-smi gives them. Plain Python: the PyTorch peers import it where TensorFlow is not."""
from __future__ import annotations

import subprocess
from pathlib import Path


class Log:
    """Prints to the terminal and to a file, flushing both at every line."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("w")

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


def nvidia_smi(field: str) -> str | None:
    """One `--query-gpu` field of the first GPU (driver_version, name, ...), or None without one."""
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None
