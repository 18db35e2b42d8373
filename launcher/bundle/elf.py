"""Shared libraries' dynamic sections, read in plain Python, and empty stand-ins built with a C compiler.

TensorFlow loads cuFFT, cuSOLVER and cuSPARSE when it registers a GPU, but a convolutional network never
calls them. An empty library with the same soname satisfies that load at a few kilobytes instead of
hundreds of megabytes. The soname must be exactly the real one: TensorFlow opens the library by it.
"""
from __future__ import annotations

import mmap
import os
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

_PT_DYNAMIC = 2
_DT_NULL, _DT_NEEDED, _DT_STRTAB, _DT_SONAME, _DT_RPATH, _DT_RUNPATH = 0, 1, 5, 14, 15, 29


class ElfError(ValueError):
    """The file is not a shared library this module can read; the message names it."""


@dataclass(frozen=True)
class Dynamic:
    """What the dynamic loader reads from a shared library: its own name, what it needs, where it looks."""

    soname: str | None
    needed: tuple[str, ...]
    runpath: tuple[str, ...]
    """DT_RUNPATH entries (or DT_RPATH where there is no RUNPATH), `$ORIGIN` left as written."""

    def search_dirs(self, library: Path) -> tuple[Path, ...]:
        """The runpath with `$ORIGIN` replaced by the library's folder, normalised (not resolved)."""
        origin = str(library.parent)
        out = []
        for entry in self.runpath:
            text = entry.replace("${ORIGIN}", origin).replace("$ORIGIN", origin)
            out.append(Path(os.path.normpath(text)))
        return tuple(out)


def is_elf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def read_dynamic(path: Path) -> Dynamic:
    """Parses the ELF program headers and the PT_DYNAMIC segment (64- and 32-bit, either byte order)."""
    path = Path(path)
    with open(path, "rb") as f:
        if f.read(4) != b"\x7fELF":
            raise ElfError(f"{path}: not an ELF file")
        # mapped, not read: TensorFlow's largest library is over a gigabyte
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse(path, data)


def _parse(path: Path, data) -> Dynamic:
    wide = {1: False, 2: True}.get(data[4])
    order = {1: "<", 2: ">"}.get(data[5])
    if wide is None or order is None:
        raise ElfError(f"{path}: unknown ELF class or byte order")
    if wide:
        e_phoff, = struct.unpack_from(order + "Q", data, 0x20)
        e_phentsize, e_phnum = struct.unpack_from(order + "HH", data, 0x36)
    else:
        e_phoff, = struct.unpack_from(order + "I", data, 0x1C)
        e_phentsize, e_phnum = struct.unpack_from(order + "HH", data, 0x2A)
    segments = []  # (type, offset, vaddr, filesz)
    for i in range(e_phnum):
        at = e_phoff + i * e_phentsize
        if wide:
            p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz = struct.unpack_from(order + "IIQQQQ", data, at)
        else:
            p_type, p_offset, p_vaddr, _paddr, p_filesz = struct.unpack_from(order + "IIIII", data, at)
        segments.append((p_type, p_offset, p_vaddr, p_filesz))
    dynamic = [s for s in segments if s[0] == _PT_DYNAMIC]
    if not dynamic:
        raise ElfError(f"{path}: no dynamic section (a static executable or an object file)")
    _, dyn_off, _, dyn_size = dynamic[0]
    entry_fmt = order + ("qQ" if wide else "iI")
    entry_size = struct.calcsize(entry_fmt)
    entries = []
    for at in range(dyn_off, dyn_off + dyn_size, entry_size):
        tag, value = struct.unpack_from(entry_fmt, data, at)
        if tag == _DT_NULL:
            break
        entries.append((tag, value))
    strtab_addr = next((v for t, v in entries if t == _DT_STRTAB), None)
    if strtab_addr is None:
        raise ElfError(f"{path}: dynamic section has no string table")
    # DT_STRTAB holds a virtual address: map it to a file offset through the load segment holding it.
    strtab = None
    for p_type, p_offset, p_vaddr, p_filesz in segments:
        if p_type == 1 and p_vaddr <= strtab_addr < p_vaddr + p_filesz:
            strtab = strtab_addr - p_vaddr + p_offset
            break
    if strtab is None:
        raise ElfError(f"{path}: string table address {strtab_addr:#x} is in no loaded segment")

    def string(offset: int) -> str:
        start = strtab + offset
        return bytes(data[start:data.find(b"\0", start)]).decode("utf-8", "replace")

    soname = next((string(v) for t, v in entries if t == _DT_SONAME), None)
    needed = tuple(string(v) for t, v in entries if t == _DT_NEEDED)
    runpath = next((string(v) for t, v in entries if t == _DT_RUNPATH), None)
    if runpath is None:
        runpath = next((string(v) for t, v in entries if t == _DT_RPATH), None)
    return Dynamic(soname, needed, tuple(p for p in (runpath or "").split(":") if p))


def build_stub(soname: str, out: Path, cc: str = "gcc") -> Path:
    """Writes an empty shared library named `soname` (DT_SONAME) to `out`; checks the result."""
    compiler = shutil.which(cc)
    if compiler is None:
        raise FileNotFoundError(
            f"no C compiler {cc!r} on PATH: the empty CUDA stand-ins are built with one "
            f"(apt-get install gcc), or pass --no-stubs to carry the real libraries")
    out = Path(out)
    with tempfile.TemporaryDirectory(prefix="lms-stub-") as tmp:
        source = Path(tmp) / "empty.c"
        source.write_text("/* stand-in for a CUDA library that TensorFlow loads but this bundle's users never call */\n")
        built = Path(tmp) / "stub.so"
        cmd = [compiler, "-shared", "-s", f"-Wl,-soname,{soname}", "-o", str(built), str(source)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"building the stand-in for {soname} failed: {' '.join(cmd)}\n{result.stderr}")
        got = read_dynamic(built).soname
        if got != soname:
            raise RuntimeError(f"the stand-in built for {soname} carries the soname {got!r}")
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, out)
        out.chmod(0o755)
    return out
