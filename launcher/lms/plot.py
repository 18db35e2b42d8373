"""`lms-launch plan --plot FILE.png`: device memory over one step, with and without LMS, against the
budget; and when each copy queue (D2H, H2D) is busy, and when recomputed ops run."""
from __future__ import annotations

from pathlib import Path

from lms_core.simulator import SimulationResult

GIB = 2**30


def plot_step(path: Path, baseline: SimulationResult, lms: SimulationResult, device_memory_bytes: int,
              budget_bytes: int, title: str, recomputed: list[tuple[float, float]] = ()) -> None:
    """`recomputed`: when the plan's recompute clones run on the compute queue, (start, end) in seconds."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on clusters and CI
    import matplotlib.pyplot as plt

    figure, (memory, queues) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True,
                                            gridspec_kw={"height_ratios": [3, 1]})
    for result, label, colour in ((baseline, "without LMS", "tab:red"), (lms, "with LMS", "tab:blue")):
        times = [0.0] + [t * 1000 for t, _ in result.timeline]
        usage = [0.0] + [b / GIB for _, b in result.timeline]
        memory.step(times, usage, where="post", color=colour,
                    label=f"{label}: peak {result.peak_device_bytes / GIB:.2f} GiB, step {result.step_time_s * 1000:.0f} ms")
    memory.axhline(device_memory_bytes / GIB, color="black", linestyle="-", linewidth=1,
                   label=f"device memory {device_memory_bytes / GIB:.1f} GiB")
    memory.axhline(budget_bytes / GIB, color="black", linestyle="--", linewidth=1,
                   label=f"budget {budget_bytes / GIB:.1f} GiB")
    memory.set_ylabel("device memory (GiB)")
    memory.set_title(title)
    memory.legend(loc="upper right", fontsize=8)
    memory.grid(alpha=0.3)

    rows = [(lms.d2h_busy, "D2H (swap-out)", "tab:orange"), (lms.h2d_busy, "H2D (swap-in)", "tab:green")]
    if recomputed:
        rows.append((list(recomputed), "recompute (compute)", "tab:purple"))
    for row, (busy, label, colour) in enumerate(rows):
        bars = [(start * 1000, max((end - start) * 1000, 1e-3)) for start, end in busy]
        queues.broken_barh(bars, (row - 0.4, 0.8), color=colour)
    queues.set_yticks(list(range(len(rows))), [label for _, label, _ in rows])
    queues.set_xlabel(f"time in the step (ms); transfer hidden behind compute: {lms.hidden_share:.0%}, "
                      f"stalls {lms.stall_time_s * 1000:.0f} ms")
    queues.grid(alpha=0.3, axis="x")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
