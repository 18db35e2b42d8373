"""Calibrated budgets kept between runs: the next run of the same step on the same kind of device
starts from the budget that fitted, and usually needs one round instead of several.

An entry is keyed by everything the calibrated budget depends on (`CacheKey`): the step's graph
fingerprint (lms_core.graph.Graph.fingerprint: model, batch, precision, optimizer), the device's name
and the memory its allocator may hold, the link, the budget the models would start from, and the
batch. Any change of those misses. Entries are JSON files named by the key's digest under
`lms.calibration_cache` (default $XDG_CACHE_HOME/lms-launch/calibration, else
~/.cache/lms-launch/calibration), written whole (a temporary file renamed into place), so ranks of a
host may write the same entry at once. A file that cannot be read, or whose key is not the one asked
for, is named in the rank's log and the step is measured afresh; the next calibration replaces it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

FORMAT = "lms-launch-calibration"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class CacheKey:
    graph: str  # the traced step's fingerprint
    device: str  # the GPU's name (NVML), or the device profile's
    device_bytes: int  # the memory the rank's allocator may hold
    link: str  # the link's rates, as lms_core.link.LinkRates.describe says them
    budget_bytes: int  # what the models' plan is made for (device memory x lms.memory_ratio)
    batch: int

    def digest(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class CachedCalibration:
    """The budget that fitted, what the device measured for it, and when."""

    key: CacheKey
    budget_bytes: int
    measured_peak_bytes: int
    predicted_peak_bytes: int
    rounds: int  # how many rounds calibration took to find it
    made: str  # UTC, ISO 8601

    def to_dict(self) -> dict:
        return {"format": FORMAT, "format_version": FORMAT_VERSION, **dataclasses.asdict(self)}

    @staticmethod
    def from_dict(data: dict) -> "CachedCalibration":
        if data.get("format") != FORMAT or data.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"not a {FORMAT} file of version {FORMAT_VERSION}")
        fields = {f.name for f in dataclasses.fields(CachedCalibration)}
        entry = {k: v for k, v in data.items() if k in fields}
        return CachedCalibration(**{**entry, "key": CacheKey(**entry["key"])})


def cache_dir(setting: str | None, environ: Mapping[str, str]) -> Path | None:
    """Where entries go: `lms.calibration_cache` (`none`: nowhere), else the user's cache folder."""
    if setting is not None:
        return None if setting.strip().lower() == "none" else Path(setting).expanduser()
    base = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".cache")
    return Path(base) / "lms-launch" / "calibration"


def entry_path(directory: Path, key: CacheKey) -> Path:
    return directory / f"{key.digest()}.json"


def load(directory: Path | None, key: CacheKey) -> tuple[CachedCalibration | None, str | None]:
    """(the entry for `key`, None) on a hit; (None, None) on a miss; (None, why) when a file is
    there but cannot be used."""
    if directory is None:
        return None, None
    path = entry_path(directory, key)
    if not path.exists():
        return None, None
    try:
        entry = CachedCalibration.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError) as err:  # JSONDecodeError is a ValueError
        return None, f"calibration cache {path} is unusable ({err}): measuring afresh"
    if entry.key != key:
        return None, f"calibration cache {path} holds another step's entry: measuring afresh"
    return entry, None


def store(directory: Path | None, entry: CachedCalibration) -> Path | None:
    """Writes `entry` whole; None when there is no cache. A cache that cannot be written is not an
    error for the run (it trains as calibrated); the caller logs the OSError's text."""
    if directory is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    path = entry_path(directory, entry.key)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(entry.to_dict(), indent=2))
    temporary.replace(path)
    return path


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass(frozen=True)
class Correction:
    """What a GPU said of a plan, for `lms-launch plan --calibration FILE`: the budget that fitted,
    the peak it measured and the simulator's peak for the same plan."""

    budget_bytes: int
    measured_peak_bytes: int
    predicted_peak_bytes: int
    device_bytes: int | None  # the memory the rank's allocator held, where the file says
    source: str  # the file, and when it was made where it says

    @property
    def unmodeled_bytes(self) -> int:
        """What the device held beyond the simulator's peak."""
        return self.measured_peak_bytes - self.predicted_peak_bytes


def read_correction(path: Path) -> Correction:
    """From a calibration cache entry, or a run's RUN_DIR/lms/plan-rank<N>.json (its kept round).
    Raises ValueError naming the file and what is wrong with it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"--calibration {path}: cannot read it ({err})") from None
    if data.get("format") == FORMAT:
        try:
            entry = CachedCalibration.from_dict(data)
        except (ValueError, TypeError, KeyError) as err:
            raise ValueError(f"--calibration {path}: not a calibration cache entry ({err})") from None
        return Correction(entry.budget_bytes, entry.measured_peak_bytes, entry.predicted_peak_bytes,
                          entry.key.device_bytes, f"{path}, made {entry.made}")
    kept = [r for r in data.get("calibration") or [] if r.get("kept") and r.get("fits")]
    if not kept:
        raise ValueError(f"--calibration {path}: neither a calibration cache entry nor a plan-rank<N>.json with a "
                         f"calibrated round that fitted (a GPU run of lms-launch writes those)")
    round_ = kept[0]
    return Correction(round_["budget_bytes"], round_["measured_peak_bytes"], round_["predicted_peak_bytes"], None,
                      str(path))
