"""The published figures a benchmark's results stand beside, each with what it measured.

Quoted from the papers' abstracts; they are real GPU runs on the authors' machines (16 GB P100/V100
GPUs), where this repository's figures are Grappler's estimates or runs on the machine at hand.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PaperFigure:
    source: str  # who, where
    model: str  # recipe model.name it is about
    kind: str  # the benchmark it compares with: max-batch or max-resolution
    ratio: float | None  # how much larger than without swapping, as the paper states it
    size: int | None  # the size reached, when the paper states one
    measure: str  # what the ratio counts, in the paper's words
    note: str = ""  # where the paper's measure differs from this benchmark's


ISMM = "Le et al., ISMM 2019 (LMS)"
TFLMS = "Le et al., TFLMS, arXiv 1807.02037"
SONY = "Hayakawa & Narihira (Sony), arXiv 2010.14109"

FIGURES = (
    PaperFigure(ISMM, "resnet50", "max-batch", 4.9, None, "4.9x larger mini-batch"),
    PaperFigure(TFLMS, "resnet50", "max-batch", 4.7, None, "4.7x larger batch size"),
    PaperFigure(SONY, "resnet50", "max-batch", 7.5, 1440, "batch 1440, 7.5x the GPU's physical memory",
                note="the ratio is of memory: batch 1440 needs 7.5x the GPU's, so about 7.5x the batch that fits "
                     "(1440 / 7.5 = 192); trained at 55% of in-memory speed"),
    PaperFigure(ISMM, "unet3d", "max-resolution", 5.6, None, "5.6x larger image resolution"),
    PaperFigure(TFLMS, "unet3d", "max-batch", 2.0, None, "2x larger batch size",
                note="a batch ratio; it trained 192^3 volumes, which it says needed image splitting before"),
)


def figures_for(model: str, kind: str) -> list[PaperFigure]:
    """The figures about this model: those of this benchmark first, then the model's others (shown
    for reference, marked with what they measured)."""
    same = [f for f in FIGURES if f.model == model and f.kind == kind]
    other = [f for f in FIGURES if f.model == model and f.kind != kind]
    return same + other
