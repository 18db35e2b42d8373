"""Unpack an lms-launch GPU bundle on a machine without network, and check TensorFlow on its GPU.

    python3 unpack.py PARTS_DIR --into DIR [--cudnn auto|machine|bundled|PATH] [--threads N]
    python3 unpack.py PARTS_DIR --verify-only        # which parts are here and intact (after each transfer)
    python3 unpack.py --check-only --into DIR [--cudnn ...]

Standard library only (Python 3.8 or newer): nothing needs to be installed on the target. PARTS_DIR
holds `manifest.json` and the `*.part` files (any subset while transferring). The command checks every
part against the manifest (a missing or damaged part is refused by name, and nothing is unpacked),
unpacks the base set into DIR/site-packages (through a temporary folder: DIR is never half-written),
writes DIR/env.sh with the paths, and runs check.py: TensorFlow's GPU list, its CUDA and cuDNN versions,
and a convolution on the GPU compared with the CPU's.

cuDNN: the base set has none. `--cudnn auto` (the default) first tries the machine's own cuDNN 9
(CUDNN_PATH, LD_LIBRARY_PATH, this Python's site-packages, `ldconfig -p`, /usr/local/cuda*), when its
minor version is at least the one TensorFlow was built with; if TensorFlow cannot use it and the
optional `cudnn-*.part` set is here, it unpacks that and checks again. `machine`, `bundled` or a path
force one choice.

Exit status: 0 when the GPU convolution matches the CPU's (or, with --verify-only, when no part is
damaged); 1 when the check fails; 2 for bad usage, a missing or damaged part, or a DIR it must not
touch.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import io
import json
import lzma
import os
import re
import shlex
import shutil
import site
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__:
    from . import manifest as bm
else:  # run as a script, in the repository or beside the parts: load the manifest module by its path
    _spec = importlib.util.spec_from_file_location("lms_bundle_manifest", Path(__file__).with_name("manifest.py"))
    bm = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = bm  # dataclasses look their module up while the class is built
    _spec.loader.exec_module(bm)

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE = 0, 1, 2
SITE = "site-packages"
MARKER = ".lms-bundle.json"
"""In DIR: the bundle's name and the archive sha256 of each set unpacked there."""
ENV_FILE = "env.sh"
CHECK = "check.py"
CUDNN_SONAME = "libcudnn.so.9"
# Environment variables this module reads or sets.
PYTHONPATH, LD_LIBRARY_PATH, CUDNN_PATH = "PYTHONPATH", "LD_LIBRARY_PATH", "CUDNN_PATH"
CUDA_CACHE_MAXSIZE = "CUDA_CACHE_MAXSIZE"
# The first GPU run compiles TensorFlow's PTX for the GPU; a cache large enough keeps it for the next.
CUDA_CACHE_BYTES = "4294967296"
MiB = 1 << 20


class UnpackError(Exception):
    """Exit 2: the message names what is wrong and what to do."""


def say(line: str) -> None:
    print(f"[unpack] {line}", flush=True)


# --- reassembly and extraction ------------------------------------------------------------------------

def decompressed_chunks(folder: Path, part_set, threads: int):
    """Yields the set's tar archive in order, its xz streams decompressed on `threads` threads."""
    src = bm.SetReader(folder, part_set)

    def job(packed: bytes, index: int, expect: int) -> bytes:
        raw = lzma.decompress(packed, format=lzma.FORMAT_XZ)  # checks each stream's CRC64
        if len(raw) != expect:
            raise UnpackError(f"set {part_set.name}: stream {index} unpacked to {len(raw)} bytes, the manifest "
                              f"says {expect}: the manifest is from another build")
        return raw

    pending: collections.deque = collections.deque()
    pool = ThreadPoolExecutor(threads)
    try:
        for index, stream in enumerate(part_set.streams):
            packed = src.read(stream.packed) if stream.packed else b""
            while len(packed) < stream.packed:  # RawIOBase.read may return short
                more = src.read(stream.packed - len(packed))
                if not more:
                    raise UnpackError(f"set {part_set.name}: the parts end before stream {index}: a part is short")
                packed += more
            pending.append(pool.submit(job, packed, index, stream.unpacked))
            while len(pending) > threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()
        pool.shutdown(wait=True)
        src.close()


class _ChunkReader(io.RawIOBase):
    def __init__(self, chunks):
        super().__init__()
        self._chunks = iter(chunks)
        self._view = memoryview(b"")
        self.total = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._view:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._view = memoryview(chunk)
        n = min(len(buffer), len(self._view))
        buffer[:n] = self._view[:n]
        self._view = self._view[n:]
        self.total += n
        return n


def extract_set(folder: Path, part_set, dest: Path, threads: int) -> float:
    """Unpacks the set into `dest` (created); returns seconds taken. Refuses members that would land
    outside `dest`."""
    t0 = time.perf_counter()
    dest.mkdir(parents=True, exist_ok=True)
    raw = _ChunkReader(decompressed_chunks(folder, part_set, threads))
    total, next_report = part_set.unpacked, 0
    kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    with tarfile.open(fileobj=io.BufferedReader(raw, MiB), mode="r|") as tar:
        for member in tar:
            name = member.name
            if name.startswith("/") or ".." in Path(name).parts:
                raise UnpackError(f"set {part_set.name}: archive member {name!r} points outside the folder")
            tar.extract(member, dest, **kwargs)
            if raw.total >= next_report:
                next_report = raw.total + max(total // 10, 64 * MiB)
                say(f"{part_set.name}: {raw.total / MiB:,.0f} of {total / MiB:,.0f} MiB unpacked "
                    f"({time.perf_counter() - t0:.1f} s)")
    say(f"{part_set.name}: {part_set.files:,} files, {total / MiB:,.0f} MiB unpacked in {time.perf_counter() - t0:.1f} s")
    return time.perf_counter() - t0


def _merge(src: Path, dst: Path) -> None:
    """Moves the tree `src` into `dst`, folder by folder where `dst` lacks one."""
    for entry in sorted(src.iterdir()):
        target = dst / entry.name
        if entry.is_dir() and not entry.is_symlink() and target.is_dir():
            _merge(entry, target)
        else:
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(entry, target)


def read_marker(into: Path) -> dict | None:
    try:
        return json.loads((into / MARKER).read_text())
    except (OSError, ValueError):
        return None


def write_marker(into: Path, marker: dict) -> None:
    tmp = into / (MARKER + ".tmp")
    tmp.write_text(json.dumps(marker, indent=1) + "\n")
    os.replace(tmp, into / MARKER)


def _check_space(where: Path, need: int) -> None:
    probe = where
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need * 1.05:
        raise UnpackError(f"{probe} has {free / MiB:,.0f} MiB free; unpacking needs {need / MiB:,.0f} MiB: "
                          f"choose --into on a larger disk")


def unpack_base(folder: Path, manifest, into: Path, threads: int) -> None:
    """DIR/site-packages from the base set, written to a sibling folder first and renamed into place."""
    base = manifest.set("base")
    marker = read_marker(into) if into.exists() else None
    if marker and marker.get("sets", {}).get("base") == base.archive_sha256:
        say(f"base set already unpacked in {into} (same build): not unpacked again")
        return
    if into.exists() and marker is None and any(into.iterdir()):
        raise UnpackError(f"{into} exists and holds no unpacked bundle ({MARKER} is missing): choose another "
                          f"--into, or empty it")
    _check_space(into.parent, base.unpacked)
    staging = into.with_name(f".{into.name}.unpacking-{os.getpid()}")
    if staging.exists():
        shutil.rmtree(staging)
    try:
        extract_set(folder, base, staging / SITE, threads)
        write_marker(staging, {"bundle": manifest.name, "sets": {"base": base.archive_sha256}})
        (staging / "bundle-manifest.json").write_text(manifest.to_json())
        here = Path(__file__).resolve().parent
        shutil.copyfile(here / CHECK, staging / CHECK)
        if into.exists():
            old = into.with_name(f".{into.name}.old-{os.getpid()}")
            say(f"replacing the bundle unpacked in {into} before ({marker.get('bundle') if marker else 'empty'})")
            os.replace(into, old)
            os.replace(staging, into)
            shutil.rmtree(old)
        else:
            into.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging, into)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def unpack_cudnn(folder: Path, manifest, into: Path, threads: int) -> None:
    cudnn = manifest.set("cudnn")
    marker = read_marker(into) or {}
    if marker.get("sets", {}).get("cudnn") == cudnn.archive_sha256:
        say("cudnn set already unpacked: not unpacked again")
        return
    _check_space(into, cudnn.unpacked)
    staging = into / f".cudnn.unpacking-{os.getpid()}"
    try:
        extract_set(folder, cudnn, staging / SITE, threads)
        _merge(staging / SITE, into / SITE)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    marker.setdefault("sets", {})["cudnn"] = cudnn.archive_sha256
    write_marker(into, marker)


# --- the machine's cuDNN ------------------------------------------------------------------------------

class Cudnn:
    """A libcudnn.so.9 found on the machine, with the version it reports."""

    def __init__(self, path: Path, source: str):
        self.path, self.source = path, source
        self.version: tuple[int, int, int] | None = None
        self.for_cuda: str | None = None
        self.error: str | None = None
        try:
            import ctypes

            lib = ctypes.CDLL(str(path))
            lib.cudnnGetVersion.restype = ctypes.c_size_t
            v = int(lib.cudnnGetVersion())
            self.version = (v // 10000, v % 10000 // 100, v % 100)
            lib.cudnnGetCudartVersion.restype = ctypes.c_size_t
            c = int(lib.cudnnGetCudartVersion())
            self.for_cuda = f"{c // 1000}.{c % 1000 // 10}"
        except (OSError, AttributeError) as err:
            self.error = f"cannot be loaded: {err}"

    def describe(self) -> str:
        if self.version is None:
            return f"{self.path} ({self.source}): {self.error}"
        return f"{self.path} ({self.source}): cuDNN {'.'.join(map(str, self.version))}, built for CUDA {self.for_cuda}"


def find_machine_cudnn(exclude: Path | None = None) -> list[Cudnn]:
    """Every libcudnn.so.9 this machine offers, most specific first, outside `exclude` (the bundle)."""
    seen, out = set(), []

    def add(path: Path, source: str) -> None:
        try:
            real = path.resolve(strict=True)
        except OSError:
            return
        if real in seen or (exclude is not None and exclude.resolve() in real.parents):
            return
        seen.add(real)
        out.append(Cudnn(path, source))

    env = os.environ.get(CUDNN_PATH)
    if env:
        for p in (Path(env), Path(env) / CUDNN_SONAME, Path(env) / "lib" / CUDNN_SONAME, Path(env) / "lib64" / CUDNN_SONAME):
            if p.is_file():
                add(p, CUDNN_PATH)
    for d in cudnn_dirs_in(os.environ.get(LD_LIBRARY_PATH, "")):
        add(Path(d) / CUDNN_SONAME, LD_LIBRARY_PATH)
    roots = list(site.getsitepackages()) + [site.getusersitepackages()]
    for root in roots:
        for pattern in (f"nvidia/*/lib/{CUDNN_SONAME}", f"nvidia/*/*/lib/{CUDNN_SONAME}"):
            for p in sorted(Path(root).glob(pattern)):
                add(p, f"Python package in {root}")
    try:
        cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        cache = ""
    for line in cache.splitlines():
        m = re.match(rf"\s*{re.escape(CUDNN_SONAME)} \(([^)]*)\) => (\S+)", line)
        if m and "64" in m.group(1):
            add(Path(m.group(2)), "ldconfig")
    for pattern in ("/usr/local/cuda/lib64", "/usr/local/cuda-*/lib64", "/usr/lib/x86_64-linux-gnu"):
        for d in sorted(Path("/").glob(pattern.lstrip("/"))):
            if (d / CUDNN_SONAME).is_file():
                add(d / CUDNN_SONAME, "system folder")
    return out


def needed_cudnn(manifest) -> tuple[int, int] | None:
    """(major, minor) of the cuDNN TensorFlow was built against, from the manifest; None if it names none."""
    text = manifest.info.get("cudnn_version")
    if not text:
        return None
    major, minor = (int(x) for x in text.split(".")[:2])
    return major, minor


# --- environment and the check ------------------------------------------------------------------------

def cudnn_dirs_in(search_path: str) -> list[str]:
    """Entries of an LD_LIBRARY_PATH value that hold a libcudnn.so.9: they would win over the bundle's."""
    return [p for p in search_path.split(os.pathsep) if p and (Path(p) / CUDNN_SONAME).exists()]


def environment(into: Path, cudnn_dir: Path | None, base: dict | None = None, drop: tuple[str, ...] = ()) -> dict:
    """The variables that make this Python use the bundle: a pure function of the choices. `drop`:
    LD_LIBRARY_PATH entries to remove (another cuDNN, when the bundle's is wanted)."""
    env = dict(os.environ if base is None else base)
    env[PYTHONPATH] = os.pathsep.join(p for p in (str(into / SITE), env.get(PYTHONPATH, "")) if p)
    search = [p for p in env.get(LD_LIBRARY_PATH, "").split(os.pathsep) if p and p not in drop]
    if cudnn_dir is not None:
        # LD_LIBRARY_PATH is searched before TensorFlow's RUNPATH (which names the bundle's nvidia/cudnn/lib)
        search.insert(0, str(cudnn_dir))
    if search or LD_LIBRARY_PATH in env:
        env[LD_LIBRARY_PATH] = os.pathsep.join(search)
    env.setdefault(CUDA_CACHE_MAXSIZE, CUDA_CACHE_BYTES)
    return env


def env_script(into: Path, cudnn_dir: Path | None, which: str, drop: tuple[str, ...] = ()) -> str:
    q = shlex.quote
    lines = ["# Written by lms-launch's unpack.py: `source` it before running TensorFlow from this bundle.",
             f"export PYTHONPATH={q(str(into / SITE))}${{PYTHONPATH:+:$PYTHONPATH}}",
             f"# cuDNN: {which}"]
    if drop:
        kept = environment(into, None, drop=drop)[LD_LIBRARY_PATH]
        lines.append(f"# without {', '.join(drop)}: another libcudnn.so.9 there would be loaded instead")
        lines.append(f"export LD_LIBRARY_PATH={q(kept)}")
    if cudnn_dir is not None:
        lines.append(f"export LD_LIBRARY_PATH={q(str(cudnn_dir))}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}")
    lines.append(f"export CUDA_CACHE_MAXSIZE=${{CUDA_CACHE_MAXSIZE:-{CUDA_CACHE_BYTES}}}")
    return "\n".join(lines) + "\n"


def run_check(into: Path, cudnn_dir: Path | None, which: str, cpu_only: bool, bundled: bool = False) -> dict:
    drop = tuple(cudnn_dirs_in(os.environ.get(LD_LIBRARY_PATH, ""))) if bundled else ()
    if drop:
        say(f"leaving {', '.join(drop)} out of LD_LIBRARY_PATH: another libcudnn.so.9 there would win over the bundle's")
    (into / ENV_FILE).write_text(env_script(into, cudnn_dir, which, drop))
    beside = Path(__file__).resolve().with_name(CHECK)
    if beside.is_file():  # the check that came with this unpacker, also for an older unpacked DIR
        shutil.copyfile(beside, into / CHECK)
    flags = ["-s"] if sys.flags.no_user_site else []  # `python3 -s unpack.py`: the check runs the same way
    cmd = [sys.executable, *flags, str(into / CHECK)] + (["--cpu-only"] if cpu_only else [])
    say(f"checking TensorFlow with cuDNN: {which}")
    say(f"$ source {into / ENV_FILE} && {' '.join(shlex.quote(c) for c in cmd)}")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=environment(into, cudnn_dir, drop=drop), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace")
    result = {"ok": False, "error": "check.py printed no RESULT line (it crashed: see above)"}
    for line in proc.stdout:
        if line.startswith("RESULT "):
            try:
                result = json.loads(line[7:])
            except ValueError:
                pass
            continue
        print("  | " + line, end="", flush=True)
    proc.wait()
    result["check_seconds"] = round(time.perf_counter() - t0, 1)
    result["exit"] = proc.returncode
    return result


def summary(result: dict, which: str, into: Path) -> list[str]:
    lines = ["== lms-launch GPU bundle: result =="]
    if "error" in result and "tensorflow" not in result:
        return lines + [f"FAILED: {result['error']}"]
    built = result.get("built_with", {})
    rt = result.get("runtime", {})
    lines.append(f"TensorFlow {result.get('tensorflow')}, built with CUDA {built.get('cuda')} and cuDNN {built.get('cudnn')}")
    gpus = ", ".join(f"{g['name']} {g.get('device')} (compute capability {g.get('compute_capability')})"
                     for g in result.get("gpus", [])) or "none"
    lines.append(f"GPUs: {gpus}")
    libs = result.get("libraries", {})
    cudnn = libs.get(CUDNN_SONAME, {}).get("path")
    lines.append(f"loaded: CUDA runtime {rt.get('cudart')} (driver supports CUDA {rt.get('driver_supports_cuda')}); "
                 f"cuDNN {rt.get('cudnn')} built for CUDA {rt.get('cudnn_built_for_cuda')}")
    if cudnn:
        origin = "the bundle's" if str(into.resolve()) in str(Path(cudnn).resolve()) else "the machine's"
        lines.append(f"cuDNN TensorFlow loaded: {cudnn} ({origin}; asked for: {which})")
    else:
        lines.append(f"cuDNN TensorFlow loaded: none (asked for: {which})")
    for name in ("conv", "conv_backward", "matmul"):
        e = result.get(name)
        if e is None:
            continue
        if "error" in e:
            lines.append(f"GPU {name}: FAILED: {e['error']}")
        else:
            lines.append(f"GPU {name} vs CPU: {'MATCHES' if e['ok'] else 'DIFFERS'} (relative difference "
                         f"{e['relative']:.1e}, tolerance {e['tolerance']:.0e}; first call {e['first_call_seconds']} s)")
    cpu = result.get("cpu_conv_vs_numpy")
    if cpu:
        lines.append(f"CPU conv vs NumPy: {'MATCHES' if cpu['ok'] else 'DIFFERS'} (relative difference "
                     f"{cpu['relative']:.1e})")
    if "error" in result:
        lines.append(f"FAILED: {result['error']}")
    verdict = "OK" if result.get("ok") else "NOT OK"
    if result.get("ok") and "conv" not in result:
        verdict = "OK on the CPU only (--cpu-only: no GPU was checked)"
    lines.append(f"{verdict}; to use it: source {into / ENV_FILE}")
    return lines


# --- the command ----------------------------------------------------------------------------------------

def _cudnn_choice(arg: str, manifest, into: Path) -> list[tuple[str, Path | None, str]]:
    """Attempts in order: (kind, folder for LD_LIBRARY_PATH or None, description)."""
    need = needed_cudnn(manifest)
    if arg == "bundled":
        return [("bundled", None, "the bundle's cudnn set")]
    if need is None:
        return [("none", None, "none: this bundle names no cuDNN")]
    attempts: list[tuple[str, Path | None, str]] = []
    if arg in ("auto", "machine"):
        found = find_machine_cudnn(exclude=into)
        for c in found:
            say(f"machine cuDNN: {c.describe()}")
        usable = [c for c in found if c.version and c.version[0] == need[0] and c.version[1] >= need[1]]
        if not found:
            say("machine cuDNN: none found")
        elif not usable:
            say(f"machine cuDNN refused: TensorFlow needs cuDNN {need[0]}.x with x >= {need[1]}")
        if usable:
            c = usable[0]
            attempts.append(("machine", c.path.resolve().parent, f"the machine's, {c.describe()}"))
        elif arg == "machine":
            raise UnpackError(f"--cudnn machine: no usable cuDNN {need[0]}.{need[1]}+ on this machine; "
                              f"set CUDNN_PATH, or use --cudnn bundled with the cudnn parts")
    elif arg != "bundled":
        path = Path(arg)
        lib = path / CUDNN_SONAME if path.is_dir() else path
        if not lib.is_file():
            raise UnpackError(f"--cudnn {arg}: no {CUDNN_SONAME} there")
        c = Cudnn(lib, "--cudnn")
        say(f"given cuDNN: {c.describe()}")
        if c.version is None:
            raise UnpackError(f"--cudnn {arg}: {c.error}")
        attempts.append(("given", lib.resolve().parent, f"given, {c.describe()}"))
    if arg == "auto":
        attempts.append(("bundled", None, "the bundle's cudnn set"))
    return attempts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unpack.py", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts_dir", nargs="?", type=Path, help="folder holding manifest.json and the *.part files")
    parser.add_argument("--into", type=Path, help="where to unpack (DIR/site-packages, DIR/env.sh)")
    parser.add_argument("--cudnn", default="auto", help="auto (default), machine, bundled, or a folder or file of libcudnn.so.9")
    parser.add_argument("--verify-only", action="store_true", help="only check the parts here against the manifest")
    parser.add_argument("--check-only", action="store_true", help="only run the GPU check on an unpacked DIR")
    parser.add_argument("--no-check", action="store_true", help="unpack and write env.sh, run no check")
    parser.add_argument("--cpu-only", action="store_true", help="the check expects no GPU (testing on a CPU machine)")
    parser.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 1), help="decompression threads")
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except (UnpackError, bm.ManifestError) as err:
        print(f"unpack.py: error: {err}", file=sys.stderr)
        return EXIT_USAGE


def _run(args) -> int:
    located = _check_only(args) if args.check_only else _verified_and_unpacked(args)
    if isinstance(located, int):
        return located  # --verify-only: the parts were all this run was for
    manifest, folder, into = located
    attempts = _cudnn_choice(args.cudnn, manifest, into)
    if args.no_check:
        return _env_without_check(args, manifest, folder, into, attempts[0])
    return _checked(args, manifest, folder, into, attempts)


def _check_only(args):
    """(manifest, parts folder or None, unpacked folder) of a bundle unpacked before."""
    if args.into is None:
        raise UnpackError("--check-only needs --into DIR (an unpacked bundle)")
    into = args.into.resolve()
    if read_marker(into) is None:
        raise UnpackError(f"{into} holds no unpacked bundle: run unpack.py PARTS_DIR --into {into} first")
    manifest = bm.Manifest.from_json((into / "bundle-manifest.json").read_text())
    return manifest, Path(args.parts_dir) if args.parts_dir else None, into


def _verified_and_unpacked(args):
    """Checks every part against the manifest; unless --verify-only, unpacks the base set. Returns
    (manifest, parts folder, unpacked folder), or the exit status of a --verify-only run."""
    if args.parts_dir is None:
        raise UnpackError("name the folder holding manifest.json and the parts: unpack.py PARTS_DIR --into DIR")
    if args.into is None and not args.verify_only:
        raise UnpackError("name where to unpack: --into DIR (or check the parts only: --verify-only)")
    folder = args.parts_dir
    manifest = bm.load(folder)
    say(f"bundle {manifest.name} (made {manifest.created}), parts in {folder}")
    t0 = time.perf_counter()
    checks = bm.verify(folder, manifest, threads=args.threads)
    for v in checks:
        for line in v.lines():
            say(line)
    known = {p.name for s in manifest.sets for p in s.parts}
    for path in sorted(Path(folder).glob("*.part")):
        if path.name not in known:
            say(f"  not in this manifest (another build?): {path.name}")
    say(f"parts checked in {time.perf_counter() - t0:.1f} s")
    bad = [name for v in checks for name, _ in v.bad]
    base = next(v for v in checks if v.set == "base")
    if args.verify_only:
        say(f"base set complete: {'yes' if base.complete else 'no'}")
        if bad:
            raise UnpackError(f"refused: {', '.join(bad)}: copy these again")
        return EXIT_OK
    if not base.complete:
        wrong = set(base.missing) | {n for n, _ in base.bad}
        names = [p.name for p in manifest.set("base").parts if p.name in wrong]
        raise UnpackError(f"the base set is incomplete; refused or missing: {', '.join(names)}. "
                          f"Nothing was unpacked. Copy these parts into {folder} and run again")
    into = args.into.resolve()
    unpack_base(folder, manifest, into, args.threads)
    return manifest, folder, into


def _env_without_check(args, manifest, folder, into: Path, attempt) -> int:
    """--no-check: the first cuDNN choice taken as it is, env.sh written, nothing run."""
    kind, cudnn_dir, which = attempt
    if kind == "bundled":
        problem = _cudnn_set_problem(folder, manifest, into)
        if problem:
            raise UnpackError(f"--cudnn {args.cudnn}: {problem}")
        unpack_cudnn(folder, manifest, into, args.threads)
    drop = tuple(cudnn_dirs_in(os.environ.get(LD_LIBRARY_PATH, ""))) if kind == "bundled" else ()
    (into / ENV_FILE).write_text(env_script(into, cudnn_dir, which, drop))
    say(f"unpacked; no check run. To use it: source {into / ENV_FILE}")
    return EXIT_OK


def _checked(args, manifest, folder, into: Path, attempts) -> int:
    """Runs the GPU check with each cuDNN choice in turn until TensorFlow works with one."""
    result, which = None, "none"
    for i, (kind, cudnn_dir, which) in enumerate(attempts):
        if kind == "bundled":
            problem = _cudnn_set_problem(folder, manifest, into)
            if problem and args.cudnn == "bundled":
                raise UnpackError(f"--cudnn bundled: {problem}")
            if problem:
                say(f"the bundle's cudnn set is not usable here: {problem}")
                if result is not None:
                    break
                # nothing tried yet: check without cuDNN, for the GPU list and TensorFlow's own messages
                kind, cudnn_dir, which = "none", None, "none (no usable cuDNN 9 on this machine, no cudnn parts here)"
            else:
                unpack_cudnn(folder, manifest, into, args.threads)
        result = run_check(into, cudnn_dir, which, args.cpu_only, bundled=kind == "bundled")
        if result.get("ok") or kind == "none":
            break
        if i + 1 < len(attempts):
            say(f"TensorFlow did not work with cuDNN from {which}; trying the next choice")
    for line in summary(result, which, into):
        print(line)
    if not result.get("ok"):
        cudnn = next((s for s in manifest.sets if s.name == "cudnn"), None)
        if cudnn is not None and not (into / SITE / "nvidia" / "cudnn").exists():
            print(f"If cuDNN is what failed: copy the {len(cudnn.parts)} cudnn parts "
                  f"({cudnn.parts[0].name} ... {cudnn.parts[-1].name}) beside the others and run again "
                  f"with --cudnn bundled")
    return EXIT_OK if result.get("ok") else EXIT_CHECK_FAILED


def _cudnn_set_problem(folder: Path | None, manifest, into: Path) -> str | None:
    """None when the cudnn set is unpacked in `into` already, or its parts are all here and intact;
    else what is wrong, by part name."""
    try:
        cudnn = manifest.set("cudnn")
    except KeyError:
        return "this bundle was made without a cudnn set"
    if (read_marker(into) or {}).get("sets", {}).get("cudnn") == cudnn.archive_sha256:
        return None
    if folder is None:
        return "name PARTS_DIR (the folder with the cudnn parts)"
    v = bm.verify(folder, manifest, ["cudnn"])[0]
    if v.complete:
        return None
    wrong = set(v.missing) | {n for n, _ in v.bad}
    names = [p.name for p in cudnn.parts if p.name in wrong]
    return f"missing or refused: {', '.join(names)} (of {len(cudnn.parts)} cudnn parts)"


if __name__ == "__main__":
    sys.exit(main())
