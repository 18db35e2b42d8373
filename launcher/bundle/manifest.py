"""The bundle's manifest, its parts' names, and the checks and reassembly the target machine runs.

Standard library only, and no imports from the project: the target machine has nothing installed
yet, so `unpack.py` loads this file by its path, in the repository or beside the parts.

A bundle is a folder holding `manifest.json`, `SHA256SUMS` and one or more *part sets*. A set is one
tar archive, compressed as a series of independent xz streams (so the target can decompress them in
parallel and `cat PARTS | xz -d | tar -x` works too), cut into parts of at most `part_size` bytes named
`SET-NN-of-MM.part`. The manifest records every part's size and sha256, every stream's packed and
unpacked length, and the sha256 of the whole compressed archive.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT = "lms-launch-gpu-bundle"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SUMS = "SHA256SUMS"
_PART_NAME = re.compile(r"^(?P<set>[a-z0-9_]+)-(?P<index>[0-9]+)-of-(?P<count>[0-9]+)\.part$")
_HASH_BLOCK = 4 << 20


class ManifestError(ValueError):
    """A manifest that cannot be read or does not describe a bundle; the message says what to do."""


@dataclass(frozen=True)
class Part:
    name: str
    """File name, `SET-NN-of-MM.part`."""
    size: int
    sha256: str


@dataclass(frozen=True)
class Stream:
    """One independent xz stream of a set's compressed archive."""

    packed: int
    unpacked: int


@dataclass(frozen=True)
class PartSet:
    name: str
    """`base`, or `cudnn` for the optional cuDNN set."""
    optional: bool
    description: str
    parts: tuple[Part, ...]
    streams: tuple[Stream, ...]
    archive_sha256: str
    """sha256 of the whole compressed archive: the parts concatenated in order."""
    files: int
    """Regular files in the archive."""

    @property
    def packed(self) -> int:
        return sum(p.size for p in self.parts)

    @property
    def unpacked(self) -> int:
        return sum(s.unpacked for s in self.streams)


@dataclass(frozen=True)
class Manifest:
    name: str
    """The bundle's name, also its folder's."""
    created: str
    part_size: int
    sets: tuple[PartSet, ...]
    info: dict = field(default_factory=dict)
    """What was carried and why, what was left out, stubs, versions: written by the packer, shown by
    `unpack.py`, never needed to unpack."""

    def set(self, name: str) -> PartSet:
        for s in self.sets:
            if s.name == name:
                return s
        raise KeyError(name)

    def to_json(self) -> str:
        doc = {"format": FORMAT, "format_version": FORMAT_VERSION, **asdict(self)}
        return json.dumps(doc, indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = MANIFEST) -> "Manifest":
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as err:
            raise ManifestError(f"{source} is not valid JSON ({err}): copy it again from the bundle folder") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ManifestError(f"{source} is not an lms-launch GPU bundle manifest")
        if doc.get("format_version") != FORMAT_VERSION:
            raise ManifestError(f"{source} has format version {doc.get('format_version')}; this unpacker reads "
                                f"version {FORMAT_VERSION}: use the unpack.py that came with the bundle")
        try:
            sets = tuple(
                PartSet(name=s["name"], optional=bool(s["optional"]), description=s["description"],
                        parts=tuple(Part(**p) for p in s["parts"]),
                        streams=tuple(Stream(**st) for st in s["streams"]),
                        archive_sha256=s["archive_sha256"], files=int(s["files"]))
                for s in doc["sets"])
            manifest = cls(name=doc["name"], created=doc["created"], part_size=int(doc["part_size"]), sets=sets,
                           info=doc.get("info", {}))
        except (KeyError, TypeError) as err:
            raise ManifestError(f"{source} lacks or mangles the field {err}: copy it again from the bundle folder") from None
        for s in manifest.sets:
            if sum(st.packed for st in s.streams) != s.packed:
                raise ManifestError(f"{source}: set {s.name!r}: its streams and its parts differ in length")
        return manifest


def load(folder: Path) -> Manifest:
    path = Path(folder) / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ManifestError(f"no {MANIFEST} in {folder}: copy it there from the bundle folder, beside the parts") from None
    return Manifest.from_json(text, str(path))


def part_name(set_name: str, index: int, count: int) -> str:
    """`part_name('base', 3, 18)` -> `base-03-of-18.part` (1-based; at least two digits)."""
    width = max(2, len(str(count)))
    return f"{set_name}-{index:0{width}d}-of-{count:0{width}d}.part"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(_HASH_BLOCK)
            if not block:
                return h.hexdigest()
            h.update(block)


def sums_text(manifest: Manifest) -> str:
    """`sha256sum -c SHA256SUMS` checks the parts without Python."""
    return "".join(f"{p.sha256}  {p.name}\n" for s in manifest.sets for p in s.parts)


@dataclass(frozen=True)
class Verification:
    """The state of one set's parts in a folder."""

    set: str
    optional: bool
    good: tuple[str, ...]
    missing: tuple[str, ...]
    bad: tuple[tuple[str, str], ...]
    """(part name, what is wrong with it)."""

    @property
    def complete(self) -> bool:
        return not self.missing and not self.bad

    def lines(self) -> list[str]:
        total = len(self.good) + len(self.missing) + len(self.bad)
        head = f"{self.set}: {len(self.good)} of {total} parts here and intact"
        if self.optional:
            head += " (optional set)"
        out = [head]
        for name, why in self.bad:
            out.append(f"  REFUSED {name}: {why}")
        if self.missing:
            out.append(f"  missing: {', '.join(self.missing)}")
        return out


def verify(folder: Path, manifest: Manifest, sets: list[str] | None = None, threads: int | None = None) -> list[Verification]:
    """Checks each part of the named sets (all by default): present, right size, right sha256."""
    folder = Path(folder)
    chosen = [manifest.set(n) for n in sets] if sets is not None else list(manifest.sets)

    def check(part: Part) -> str | None:
        path = folder / part.name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return "missing"
        if size != part.size:
            return (f"{size} bytes, the manifest says {part.size} (cut short in transfer, or from another "
                    f"build): copy it again")
        if sha256_file(path) != part.sha256:
            return "sha256 differs from the manifest (corrupted in transfer, or from another build): copy it again"
        return None

    everything = [p for s in chosen for p in s.parts]
    workers = threads or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max(1, workers)) as pool:  # hashlib releases the GIL on large blocks
        results = dict(zip((p.name for p in everything), pool.map(check, everything)))
    out = []
    for s in chosen:
        good = tuple(p.name for p in s.parts if results[p.name] is None)
        missing = tuple(p.name for p in s.parts if results[p.name] == "missing")
        bad = tuple((p.name, results[p.name]) for p in s.parts if results[p.name] not in (None, "missing"))
        out.append(Verification(s.name, s.optional, good, missing, bad))
    return out


class SetReader(io.RawIOBase):
    """The parts of a set, read in order as one stream: the compressed archive, reassembled."""

    def __init__(self, folder: Path, part_set: PartSet):
        super().__init__()
        self._paths = [Path(folder) / p.name for p in part_set.parts]
        self._index = 0
        self._file = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._index < len(self._paths):
            if self._file is None:
                self._file = open(self._paths[self._index], "rb")
            n = self._file.readinto(buffer)
            if n:
                return n
            self._file.close()
            self._file = None
            self._index += 1
        return 0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        super().close()


def reassemble(folder: Path, part_set: PartSet, out: Path) -> Path:
    """Writes the set's compressed archive to `out` (via a temporary name) and checks its sha256."""
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    h = hashlib.sha256()
    try:
        with SetReader(folder, part_set) as src, open(tmp, "wb") as dst:
            while True:
                block = src.read(_HASH_BLOCK)
                if not block:
                    break
                h.update(block)
                dst.write(block)
        if h.hexdigest() != part_set.archive_sha256:
            raise ManifestError(f"set {part_set.name}: the reassembled archive's sha256 differs from the manifest "
                                f"although each part matched: the manifest is from another build")
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out


def parse_part_name(name: str) -> tuple[str, int, int] | None:
    """`base-03-of-18.part` -> ('base', 3, 18); None for any other name."""
    m = _PART_NAME.match(name)
    return (m["set"], int(m["index"]), int(m["count"])) if m else None
