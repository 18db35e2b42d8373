"""Per-rank throughput and memory: what is measured, and the sinks it goes to.

Every `logging.interval` steps each rank produces one `IntervalRecord`; rank 0 gathers them from all
ranks (a small allgather per interval, never per step) and is the only writer, so the run directory
may live on rank 0's host alone. Sinks share one interface: `write(records)` and `close()`.

metrics.jsonl fields (one JSON object per rank per interval):
  rank, host, device        which rank, on which host, computing on which device ("GPU:0", "CPU:0")
  step                      the last step of the interval (1-based)
  steps                     steps in the interval
  step_time_s               mean wall time of one step in the interval (the interval is timed as a
                            whole, ending with a device sync, so queued work is counted)
  samples_per_sec           samples this rank processed per second over the interval
  voxels_per_sec            3D U-Net only: samples_per_sec x voxels per sample
  tokens_per_sec            Seq2Seq only: real target tokens (padding left out, as in the loss)
                            this rank processed per second over the interval
  peak_memory_bytes         peak bytes allocated on the compute device during the interval
                            (tf.config.experimental.get_memory_info, reset each interval)
  host_rss_bytes            resident memory of the rank's process at the end of the interval
  loss                      training loss of the interval's last step
  learning_rate             learning rate used at that step
  end_time_s                when the interval ended (Unix time, seconds): the gaps between intervals,
                            where the ranks gather these records, can be timed from it
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Protocol

from lms_core.units import format_bytes


@dataclass
class IntervalRecord:
    rank: int
    host: str
    device: str
    step: int
    steps: int
    step_time_s: float
    samples_per_sec: float
    voxels_per_sec: float | None
    peak_memory_bytes: int
    host_rss_bytes: int
    loss: float
    learning_rate: float
    end_time_s: float
    tokens_per_sec: float | None = None


class DeviceMemoryMonitor:
    """Peak device memory per interval, as torchtitan's DeviceMemoryMonitor does for PyTorch."""

    def __init__(self, device: str):
        import tensorflow as tf

        self._tf = tf
        self.device = device
        self.reset()

    def reset(self) -> None:
        self._tf.config.experimental.reset_memory_stats(self.device)

    def peak_bytes(self) -> int:
        return int(self._tf.config.experimental.get_memory_info(self.device)["peak"])


def host_rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


class MetricsSink(Protocol):
    def write(self, records: list[IntervalRecord]) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """RUN_DIR/metrics.jsonl: appended and flushed each interval so a crash keeps what was measured."""

    def __init__(self, path: Path):
        self._file = open(path, "a", encoding="utf-8")

    def write(self, records: list[IntervalRecord]) -> None:
        for record in records:
            self._file.write(json.dumps(asdict(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """RUN_DIR/tensorboard/rank<N>: one event stream per rank, so TensorBoard overlays the ranks."""

    SCALARS = ("samples_per_sec", "step_time_s", "peak_memory_bytes", "host_rss_bytes", "loss",
               "learning_rate", "voxels_per_sec", "tokens_per_sec")

    def __init__(self, directory: Path):
        self._directory = directory
        self._writers: dict[int, object] = {}

    def write(self, records: list[IntervalRecord]) -> None:
        import tensorflow as tf

        for record in records:
            writer = self._writers.get(record.rank)
            if writer is None:
                writer = tf.summary.create_file_writer(str(self._directory / f"rank{record.rank}"))
                self._writers[record.rank] = writer
            with writer.as_default(step=record.step):
                for name in self.SCALARS:
                    value = getattr(record, name)
                    if value is not None:
                        tf.summary.scalar(name, value)
            writer.flush()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()


class ConsoleSink:
    """One line per interval: rank 0's figures and the sum over ranks. The launcher's progress bar
    reads metrics.jsonl; this line is what logs and non-terminal runs see."""

    def __init__(self, total_steps: int, print_fn=print):
        self._total_steps = total_steps
        self._print = print_fn

    def write(self, records: list[IntervalRecord]) -> None:
        if not records:
            return
        first = min(records, key=lambda r: r.rank)
        total = sum(r.samples_per_sec for r in records)
        peak = max(r.peak_memory_bytes for r in records)
        self._print(
            f"step {first.step}/{self._total_steps}  loss {first.loss:.4f}  "
            f"{total:.1f} samples/s over {len(records)} rank(s)  "
            f"step {first.step_time_s * 1000:.0f} ms  peak {format_bytes(peak)} (max over ranks)"
        )

    def close(self) -> None:
        pass


class MetricsLogger:
    """Fans records out to every sink."""

    def __init__(self, sinks: Iterable[MetricsSink]):
        self.sinks = list(sinks)

    def write(self, records: list[IntervalRecord]) -> None:
        for sink in self.sinks:
            sink.write(records)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


@dataclass
class RankSummary:
    """One rank's figures over the whole measured part of the run."""

    rank: int
    host: str
    device: str
    measured_steps: int
    samples_per_sec: float
    voxels_per_sec: float | None
    step_time_s: float
    peak_memory_bytes: int
    host_rss_bytes: int
    initial_loss: float
    final_loss: float
    weights_sha256: str
    tokens_per_sec: float | None = None


def summarize_rank(rank: int, host: str, device: str, records: list[IntervalRecord],
                   initial_loss: float, final_loss: float, weights_sha256: str) -> RankSummary:
    """Throughput over all measured steps (total samples / total time, not a mean of rates)."""
    steps = sum(r.steps for r in records)
    seconds = sum(r.steps * r.step_time_s for r in records)
    samples = sum(r.samples_per_sec * r.steps * r.step_time_s for r in records)
    rate = samples / seconds if seconds > 0 else 0.0
    voxels = tokens = None
    if records and records[0].voxels_per_sec is not None and records[0].samples_per_sec > 0:
        voxels = rate * records[0].voxels_per_sec / records[0].samples_per_sec
    if records and records[0].tokens_per_sec is not None and seconds > 0:
        # Real tokens per sample vary with the batches (padding is not counted): total over total time.
        tokens = sum(r.tokens_per_sec * r.steps * r.step_time_s for r in records) / seconds
    return RankSummary(
        rank=rank, host=host, device=device, measured_steps=steps, samples_per_sec=rate,
        voxels_per_sec=voxels, step_time_s=seconds / steps if steps else math.nan,
        peak_memory_bytes=max((r.peak_memory_bytes for r in records), default=0),
        host_rss_bytes=max((r.host_rss_bytes for r in records), default=0),
        initial_loss=initial_loss, final_loss=final_loss, weights_sha256=weights_sha256, tokens_per_sec=tokens,
    )


def build_summary(ranks: list[RankSummary], extra: dict) -> dict:
    """summary.json: per-rank figures and their totals; `extra` adds run facts (model, batch, LMS)."""
    ranks = sorted(ranks, key=lambda r: r.rank)
    voxel_rates = [r.voxels_per_sec for r in ranks if r.voxels_per_sec is not None]
    token_rates = [r.tokens_per_sec for r in ranks if r.tokens_per_sec is not None]
    summary = dict(extra)
    summary.update({
        "ranks": [asdict(r) for r in ranks],
        "total_samples_per_sec": sum(r.samples_per_sec for r in ranks),
        "total_voxels_per_sec": sum(voxel_rates) if voxel_rates else None,
        "total_tokens_per_sec": sum(token_rates) if token_rates else None,
        "max_peak_memory_bytes": max((r.peak_memory_bytes for r in ranks), default=0),
        "total_peak_memory_bytes": sum(r.peak_memory_bytes for r in ranks),
        "weights_in_sync": len({r.weights_sha256 for r in ranks}) == 1,
    })
    return summary


def format_summary_table(summary: dict) -> str:
    """The table printed at the end of a run."""
    header = f"{'rank':>4}  {'host':<14} {'device':<7} {'samples/s':>10} {'step ms':>8} {'peak mem':>10} {'host RSS':>10} {'loss':>15}"
    lines = [header, "-" * len(header)]
    for r in summary["ranks"]:
        lines.append(
            f"{r['rank']:>4}  {r['host'][:14]:<14} {r['device']:<7} {r['samples_per_sec']:>10.2f} "
            f"{r['step_time_s'] * 1000:>8.1f} {format_bytes(r['peak_memory_bytes']):>10} "
            f"{format_bytes(r['host_rss_bytes']):>10} {r['initial_loss']:>6.3f} -> {r['final_loss']:<6.3f}"
        )
    lines.append("-" * len(header))
    lines.append(
        f"{'all':>4}  {len(summary['ranks'])} rank(s){'':<14} {summary['total_samples_per_sec']:>10.2f} "
        f"{'':>8} {format_bytes(summary['total_peak_memory_bytes']):>10}  (peak: sum over ranks)"
    )
    if summary.get("total_voxels_per_sec"):
        lines.append(f"      voxels/s, all ranks: {summary['total_voxels_per_sec']:.4g}")
    if summary.get("total_tokens_per_sec"):
        lines.append(f"      target tokens/s, all ranks: {summary['total_tokens_per_sec']:.4g}")
    lines.append("      weights identical on all ranks: " + ("yes" if summary["weights_in_sync"] else "NO"))
    return "\n".join(lines)
