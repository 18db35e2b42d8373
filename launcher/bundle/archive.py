"""Packs a folder's files into one part set: tar, compressed in independent xz streams, cut into parts.

Why xz and not zstd: the target machine must unpack with nothing but Python's standard library, which
reads xz (`lzma`) and not zstd (before Python 3.14). Measured here on 512 MiB of TensorFlow and cuBLAS
libraries: xz -9 made 165 MB, zstd -9 --long=27 201 MB, zstd -19 --long=27 180 MB (and took twice
xz's time). Each stream holds `chunk` bytes of the tar, compressed on its own: the streams compress in
parallel here and decompress in parallel there, at the same size as one xz -9 stream (165.0 MB) on
that sample with 64 MiB chunks.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import lzma
import os
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

from launcher.bundle.manifest import Part, PartSet, SetReader, Stream, part_name

MiB = 1 << 20
DEFAULT_CHUNK = 64 * MiB
DEFAULT_PRESET = 9

Progress = Callable[[str], None]


def files_under(root: Path, members: Iterable[str]) -> list[str]:
    """Relative paths of the files and symbolic links under `root`/member for each member, sorted."""
    root = Path(root)
    out = set()
    for member in members:
        top = root / member
        if not top.exists() and not top.is_symlink():
            raise FileNotFoundError(f"{top}: listed for the bundle but not there")
        if top.is_dir() and not top.is_symlink():
            for dirpath, dirnames, filenames in os.walk(top):
                dirnames.sort()
                for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
                    out.add(os.path.relpath(os.path.join(dirpath, name), root))
        else:
            out.add(os.path.relpath(top, root))
    return sorted(out)


class _PartWriter:
    """Cuts a byte stream into files of `part_size` bytes, hashing each and the whole."""

    def __init__(self, folder: Path, set_name: str, part_size: int):
        if part_size <= 0:
            raise ValueError("part size must be positive")
        self.folder, self.set_name, self.part_size = Path(folder), set_name, part_size
        self._done: list[tuple[Path, int, str]] = []
        self._file = None
        self._hash = None
        self._left = 0
        self.whole = hashlib.sha256()
        self.written = 0

    def _open_next(self) -> None:
        path = self.folder / f".{self.set_name}-{len(self._done) + 1:05d}.writing"
        self._file, self._hash, self._left = open(path, "wb"), hashlib.sha256(), self.part_size
        self._path = path

    def _close_current(self) -> None:
        self._file.close()
        self._done.append((self._path, self.part_size - self._left, self._hash.hexdigest()))
        self._file = None

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        self.whole.update(view)
        self.written += len(view)
        while view:
            if self._file is None:
                self._open_next()
            piece = view[:self._left]
            self._file.write(piece)
            self._hash.update(piece)
            self._left -= len(piece)
            view = view[len(piece):]
            if self._left == 0:
                self._close_current()

    def discard(self) -> None:
        """After a failure: close the open part (the caller removes the folder)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    @property
    def parts_so_far(self) -> int:
        return len(self._done) + (self._file is not None)

    def finish(self) -> tuple[Part, ...]:
        if self._file is not None:
            self._close_current()
        count = len(self._done)
        parts = []
        for i, (path, size, digest) in enumerate(self._done, 1):
            name = part_name(self.set_name, i, count)
            os.replace(path, self.folder / name)
            parts.append(Part(name, size, digest))
        return tuple(parts)


class _ChunkCompressor:
    """A write-only file for tarfile: every `chunk` bytes become one xz stream, compressed on a thread
    pool (lzma releases the GIL), written to the part writer in order."""

    def __init__(self, writer: _PartWriter, chunk: int, preset: int, threads: int,
                 on_stream: Callable[[int, int], None]):
        self.writer, self.chunk, self.preset = writer, chunk, preset
        self.pool = ThreadPoolExecutor(threads)
        self.ahead = threads + 1  # streams in flight: enough to keep every thread busy, bounded memory
        self.pending: collections.deque = collections.deque()
        self.buffer = bytearray()
        self.streams: list[Stream] = []
        self.on_stream = on_stream

    def _compress(self, raw: bytes) -> tuple[bytes, int]:
        return lzma.compress(raw, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=self.preset), len(raw)

    def _drain(self, keep: int) -> None:
        while len(self.pending) > keep:
            packed, raw_len = self.pending.popleft().result()
            self.writer.write(packed)
            self.streams.append(Stream(len(packed), raw_len))
            self.on_stream(len(packed), raw_len)

    def write(self, data) -> int:
        self.buffer += data
        while len(self.buffer) >= self.chunk:
            raw = bytes(self.buffer[:self.chunk])
            del self.buffer[:self.chunk]
            self.pending.append(self.pool.submit(self._compress, raw))
            self._drain(self.ahead)
        return len(data)

    def finish(self) -> None:
        if self.buffer:
            self.pending.append(self.pool.submit(self._compress, bytes(self.buffer)))
            self.buffer = bytearray()
        self._drain(0)
        self.pool.shutdown()

    def abandon(self) -> None:
        for f in self.pending:
            f.cancel()
        self.pool.shutdown(wait=True)


def _tarinfo(tar: tarfile.TarFile, path: Path, arcname: str) -> tarfile.TarInfo:
    info = tar.gettarinfo(str(path), arcname)
    info.uid = info.gid = 0
    info.uname = info.gname = ""  # the builder's user means nothing on the target
    return info


def pack_set(root: Path, members: Iterable[str], folder: Path, set_name: str, *, part_size: int,
             optional: bool = False, description: str = "", chunk: int = DEFAULT_CHUNK,
             preset: int = DEFAULT_PRESET, threads: int | None = None,
             progress: Progress | None = None) -> PartSet:
    """Writes the set's parts into `folder` (which the caller makes and later renames into place) and
    returns their description for the manifest. Member paths are relative to `root` and keep that
    layout in the archive."""
    root, folder = Path(root), Path(folder)
    files = files_under(root, members)
    # the tar's size, about: a 512-byte header per member and contents padded to 512 bytes
    total = sum(512 + -(-(root / f).lstat().st_size // 512) * 512 for f in files)
    say = progress or (lambda line: None)
    writer = _PartWriter(folder, set_name, part_size)
    seen = {"raw": 0, "next": 0}

    def on_stream(packed: int, raw: int) -> None:
        seen["raw"] += raw
        if seen["raw"] >= seen["next"] or seen["raw"] >= total:
            seen["next"] = seen["raw"] + max(total // 10, chunk)
            say(f"{set_name}: {seen['raw'] / MiB:,.0f} of ~{total / MiB:,.0f} MiB compressed into "
                f"{writer.written / MiB:,.0f} MiB ({writer.parts_so_far} part(s) so far)")

    sink = _ChunkCompressor(writer, chunk, preset, threads or os.cpu_count() or 1, on_stream)
    regular = 0
    try:
        with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT, bufsize=MiB) as tar:
            for rel in files:
                path = root / rel
                info = _tarinfo(tar, path, rel)
                if info.isreg():
                    regular += 1
                    with open(path, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
        sink.finish()
    except BaseException:
        sink.abandon()
        writer.discard()
        raise
    parts = writer.finish()
    return PartSet(name=set_name, optional=optional, description=description, parts=parts,
                   streams=tuple(sink.streams), archive_sha256=writer.whole.hexdigest(), files=regular)


def recut(folder: Path, part_set: PartSet, out: Path, part_size: int) -> PartSet:
    """The same compressed archive, cut into parts of `part_size` in `out`."""
    writer = _PartWriter(out, part_set.name, part_size)
    try:
        with SetReader(folder, part_set) as src:
            for block in iter(lambda: src.read(4 * MiB), b""):
                writer.write(block)
    except BaseException:
        writer.discard()
        raise
    if writer.whole.hexdigest() != part_set.archive_sha256:
        writer.discard()
        raise ValueError(f"set {part_set.name}: the parts read back differ from the manifest's archive")
    return dataclasses.replace(part_set, parts=writer.finish())
