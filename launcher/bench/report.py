"""What `lms-launch bench` writes: a Markdown table, a CSV, a PNG bar chart and the raw probes, with
the papers' figures beside the results, all into one run directory that appears whole or not at all.

The directory is built under a hidden sibling name and renamed into place at the end (one rename on
one filesystem), so an interrupted or failed benchmark leaves no half-written results behind.
"""
from __future__ import annotations

import csv
import io
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from launcher.bench.configurations import FLOORS
from launcher.bench.floor import Floor
from launcher.bench.papers import PaperFigure
from launcher.bench.search import SearchResult
from launcher.bench.sizes import SizeAxis
from lms_core.units import format_bytes

TABLE_FILE = "results.md"
CSV_FILE = "results.csv"
CHART_FILE = "results.png"
PROBES_FILE = "probes.csv"
JSON_FILE = "bench.json"
PLAN_FILE = "plan-lms-launch.json"

CSV_COLUMNS = ["configuration", "source", "judge", "largest_size", "size", "ratio_to_no_swapping", "samples_per_s",
               "samples_per_s_kind", "overhead", "peak_bytes", "floor_bytes", "peak_over_floor", "probes", "seconds",
               "note"]


@dataclass
class ConfigurationResult:
    """One row: a configuration's search and what was worked out at the size it found."""

    key: str  # none, grappler, lms-launch, floor
    label: str
    search: SearchResult
    floor: Floor | None = None  # at the largest size
    samples_per_s: float | None = None  # predicted (estimate judge) or measured (run judge) at the largest size
    overheads: dict[str, float | None] = field(default_factory=dict)  # link -> overhead at the largest size
    link_fits: dict[str, bool] = field(default_factory=dict)  # link -> the plan re-tuned for it still fits
    notes: list[str] = field(default_factory=list)

    @property
    def largest(self) -> int | None:
        return self.search.largest

    @property
    def peak_bytes(self) -> int | None:
        """The judge's peak at the largest size (the floor row has none: its figure is the floor)."""
        probe = self.search.probe_at(self.largest)
        return None if probe is None or self.key in FLOORS else probe.peak_bytes


@dataclass
class BenchReport:
    kind: str
    recipe: str
    model: str
    input_shape: list[int]
    batch_size: int
    axis: SizeAxis
    judge: str  # estimate or run
    judge_text: str  # one line: what the judge is
    command: str
    date: str
    machine: str
    device_memory_bytes: int | None
    link: str  # the link predictions are made for (estimate), or what the ranks detect (run)
    links: list[str]  # the links overheads are shown for
    results: list[ConfigurationResult]
    papers: list[PaperFigure]
    seconds: float
    notes: list[str] = field(default_factory=list)
    lms_plan: dict | None = None  # the plan lms-launch found at its largest size

    def reference(self) -> int | None:
        """The no-swapping size the ratios are taken against."""
        return next((r.largest for r in self.results if r.key == "none"), None)

    @property
    def samples_kind(self) -> str:
        return "measured" if self.judge == "run" else "predicted"


def _ratio(report: BenchReport, size: int | None) -> float | None:
    return report.axis.ratio(size, report.reference())


UNITS = {1: "samples", 2: "pixels", 3: "voxels"}


def overhead_title(link: str) -> str:
    """A column of predicted overheads: on a named link (re-tuned for it), or as each rank planned it."""
    return "overhead (the rank's plan, predicted)" if link == "rank" else f"overhead {link}"


def _fmt_ratio(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _fmt_overhead(value: float | None, fits: bool | None = None) -> str:
    if value is None:
        return "-"
    text = f"{value:+.0%}"
    return text if fits in (None, True) else f"{text} (does not fit)"


def _size_text(report: BenchReport, result: ConfigurationResult) -> str:
    text = report.axis.label(result.largest)
    if result.search.bounded:
        text += " (the --max bound)"
    return text


def markdown(report: BenchReport) -> str:
    axis = report.axis
    lines = [f"# lms-launch bench {report.kind}: {report.model} {report.input_shape}, batch {report.batch_size}",
             "",
             f"- command: `{report.command}`",
             f"- date: {report.date}; machine: {report.machine}; took {report.seconds:.0f} s",
             f"- judge: {report.judge_text}",
             f"- size: {axis.describe()}; ratios are in {UNITS[axis.dims]} against no swapping",
             ""]
    overhead_header = " | ".join(overhead_title(link) for link in report.links)
    lines += [f"| configuration | largest size | ratio to no swapping | samples/s ({report.samples_kind}) | "
              f"{overhead_header} | peak at that size | floor at that size | peak / floor | probes | search s |",
              "| --- " * (9 + len(report.links)) + "|"]
    for result in report.results:
        floor = result.floor.total_bytes if result.floor else None
        peak = result.peak_bytes
        per_floor = f"{peak / floor:.2f}" if peak and floor else "-"
        overheads = " | ".join(_fmt_overhead(result.overheads.get(link), result.link_fits.get(link))
                               for link in report.links)
        samples = "-" if result.samples_per_s is None else f"{result.samples_per_s:.4g}"
        ratio = _fmt_ratio(_ratio(report, result.largest))
        lines.append(f"| {result.label} | {_size_text(report, result)} | {ratio} | {samples} | {overheads} | "
                     f"{format_bytes(peak)} | {format_bytes(floor)} | {per_floor} | {len(result.search.probes)} | "
                     f"{result.search.seconds:.0f} |")
    if report.papers:  # the papers' models only; your own model has none
        lines += ["", "Published figures (real GPUs, each against its own no-swapping baseline):", "",
                  "| source | model | what it reports | ratio | note |", "| --- | --- | --- | --- | --- |"]
    for paper in report.papers:
        lines.append(f"| {paper.source} | {paper.model} | {paper.measure} | {_fmt_ratio(paper.ratio)} | {paper.note} |")
    notes = [note for result in report.results for note in (f"{result.label}: {n}" for n in result.notes)]
    notes += report.notes
    if notes:
        lines += ["", "Notes:", ""] + [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def csv_text(report: BenchReport) -> str:
    buffer = io.StringIO()
    columns = CSV_COLUMNS + [f"overhead_{link}" for link in report.links]
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for result in report.results:
        floor = result.floor.total_bytes if result.floor else None
        peak = result.peak_bytes
        ratio = _ratio(report, result.largest)
        row = {"configuration": result.key, "source": "this run", "judge": report.judge,
               "largest_size": result.largest, "size": _size_text(report, result),
               "ratio_to_no_swapping": None if ratio is None else round(ratio, 4),
               "samples_per_s": None if result.samples_per_s is None else round(result.samples_per_s, 3),
               "samples_per_s_kind": report.samples_kind if result.samples_per_s is not None else "",
               "overhead": _round(result.overheads.get(report.link)), "peak_bytes": peak, "floor_bytes": floor,
               "peak_over_floor": round(peak / floor, 4) if peak and floor else None,
               "probes": len(result.search.probes), "seconds": round(result.search.seconds, 1),
               "note": "; ".join(result.notes)}
        row.update({f"overhead_{link}": _round(result.overheads.get(link)) for link in report.links})
        writer.writerow(row)
    for paper in report.papers:
        writer.writerow({"configuration": "paper", "source": paper.source, "judge": "published",
                         "largest_size": paper.size, "size": paper.measure, "ratio_to_no_swapping": paper.ratio,
                         "note": paper.note})
    return buffer.getvalue()


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def probes_csv(report: BenchReport) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["configuration", "order", "size", "fits", "peak_bytes", "seconds", "detail"])
    for result in report.results:
        for order, probe in enumerate(result.search.probes, 1):
            writer.writerow([result.key, order, probe.size, probe.fits, probe.peak_bytes, round(probe.seconds, 2),
                             probe.detail])
    return buffer.getvalue()


def chart_bars(report: BenchReport) -> list[dict]:
    """The chart's bars, in order: this run's configurations, the floor, then the papers' figures
    that measured what this benchmark measures (the others are in the table only)."""
    bars = [{"label": result.label, "ratio": _ratio(report, result.largest), "size": _size_text(report, result),
             "source": "bound" if result.key in FLOORS else "this run"} for result in report.results]
    bars += [{"label": f"{paper.source}: {paper.measure}", "ratio": paper.ratio,
              "size": report.axis.label(paper.size) if paper.size else None, "source": "paper"}
             for paper in report.papers if paper.kind == report.kind]
    return bars


BAR_STYLES = {"this run": {"color": "tab:blue"}, "bound": {"color": "white", "hatch": ".."},
              "paper": {"color": "lightgrey", "hatch": "//"}}
LEGEND = {"this run": "this run", "bound": "floor: no plan can pass it", "paper": "published (real GPUs)"}


def write_chart(report: BenchReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    bars = chart_bars(report)
    figure, axes = plt.subplots(figsize=(11, 5.5))
    seen = set()
    for x, bar in enumerate(bars):
        label = LEGEND[bar["source"]] if bar["source"] not in seen else None
        seen.add(bar["source"])
        patch = axes.bar(x, bar["ratio"] or 0.0, edgecolor="black", label=label, **BAR_STYLES[bar["source"]])[0]
        text = "-" if bar["ratio"] is None else f"{bar['ratio']:.2f}x"
        if bar["size"]:
            text += f"\n{bar['size']}"
        axes.annotate(text, (patch.get_x() + patch.get_width() / 2, patch.get_height()), ha="center", va="bottom",
                      fontsize=8, xytext=(0, 2), textcoords="offset points")
    axes.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    axes.set_xticks(range(len(bars)), [_wrap(bar["label"]) for bar in bars], fontsize=7)
    what = "batch" if report.axis.dims == 1 else "input, in pixels" if report.axis.dims == 2 else "input, in voxels"
    axes.set_ylabel(f"largest {what} / no swapping")
    judged = (f"Grappler's estimate, {format_bytes(report.device_memory_bytes)} virtual GPU"
              if report.judge == "estimate" else "measured by running it")
    axes.set_title(f"{report.model} {report.input_shape}, batch {report.batch_size}: largest {what} that fits "
                   f"({judged})", fontsize=9)
    axes.legend(fontsize=8, loc="upper left")
    axes.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100, metadata={"Title": f"lms-launch bench {report.kind} {report.model}",
                                            "Description": json.dumps(bars)})
    plt.close(figure)


def _wrap(text: str, width: int = 18) -> str:
    words, lines, line = text.split(), [], ""
    for word in words:
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return "\n".join(lines + [line])


def report_json(report: BenchReport) -> dict:
    return {
        "kind": report.kind, "recipe": report.recipe, "model": report.model, "input_shape": report.input_shape,
        "batch_size": report.batch_size, "judge": report.judge, "judge_text": report.judge_text,
        "command": report.command, "date": report.date, "machine": report.machine,
        "device_memory_bytes": report.device_memory_bytes, "link": report.link, "links": report.links,
        "seconds": round(report.seconds, 1), "size_step": report.axis.step, "notes": report.notes,
        "results": [{
            "configuration": r.key, "label": r.label, "largest": r.largest, "bounded": r.search.bounded,
            "smallest_failing": r.search.smallest_failing, "ratio_to_no_swapping": _ratio(report, r.largest),
            "peak_bytes": r.peak_bytes, "floor": r.floor.to_dict() if r.floor else None,
            "samples_per_s": r.samples_per_s, "samples_per_s_kind": report.samples_kind, "overheads": r.overheads,
            "link_fits": r.link_fits, "notes": r.notes, "seconds": round(r.search.seconds, 1),
            "probes": [{"size": p.size, "fits": p.fits, "peak_bytes": p.peak_bytes, "seconds": round(p.seconds, 2),
                        "detail": p.detail, **{k: v for k, v in p.data.items() if not k.endswith("_object")}}
                       for p in r.search.probes],
        } for r in report.results],
        "papers": [paper.__dict__ for paper in report.papers],
    }


def partial_dir(out: Path) -> Path:
    """The hidden folder the results are built in, beside `out`."""
    out = out.absolute()
    return out.parent / f".{out.name}.partial-{os.getpid()}"


def write_report(report: BenchReport, work: Path, out: Path) -> None:
    """Writes every file into `work` (the partial folder, which may already hold probe folders),
    then renames it to `out` in one step."""
    (work / TABLE_FILE).write_text(markdown(report))
    (work / CSV_FILE).write_text(csv_text(report))
    (work / PROBES_FILE).write_text(probes_csv(report))
    (work / JSON_FILE).write_text(json.dumps(report_json(report), indent=2, default=str))
    if report.lms_plan is not None:
        (work / PLAN_FILE).write_text(json.dumps(report.lms_plan, indent=2))
    write_chart(report, work / CHART_FILE)
    if out.exists():
        out.rmdir()  # checked empty before the benchmark started
    os.rename(work, out)


def discard(work: Path) -> None:
    shutil.rmtree(work, ignore_errors=True)
