"""Make an offline bundle of lms-launch's GPU runtime for a machine without network.

    lms-launch bundle --python 3.11 --have mycluster.txt --part-size 200MiB --out /scratch/bundles
    lms-launch bundle --have h100-cuda-image            # a CUDA 13 image with Python 3.12 (launcher/bundle/targets)
    lms-launch bundle resplit bundle/NAME --part-size 2GiB   # same archives, other part size

On a machine with network (to PyPI), with the project's .venv: resolves TensorFlow 2.18.1 with its CUDA 12
libraries and lms-launch's own runtime packages for the target's Python and platform; keeps what the
target already has in a fitting version (`--have`, a `pip list --format=freeze` file); downloads the
rest into a cache (reused on the next run); installs it into a site-packages tree; leaves out what a
one-rank GPU run never loads; replaces cuFFT, cuSOLVER and cuSPARSE by empty libraries of the same
soname; and packs it as two part sets of at most `--part-size` bytes each: `base` and the optional
`cudnn`. The bundle folder (OUT/NAME) gets the parts, manifest.json, SHA256SUMS, and the target-side
unpack.py with what it needs. docs/gpu-bundle.md has the whole procedure.

Exit status: 0 when the bundle was written; 2 for bad input (nothing written); 1 when a step failed
(nothing written: the bundle folder is built under a temporary name and renamed at the end).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from packaging.utils import canonicalize_name
from packaging.version import Version

from launcher.arguments import USAGE_STATUS, UsageError, UsageParser
from launcher.bundle import archive, elf, have as havemod
from launcher.bundle.manifest import MANIFEST, SUMS, Manifest, ManifestError, sums_text, verify
from launcher.bundle.manifest import load as load_manifest
from lms_core.units import format_bytes, parse_bytes

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
TARGETS = HERE / "targets"
MiB = 1 << 20

TENSORFLOW = "tensorflow[and-cuda]==2.18.1"
# lms-launch's own runtime packages (pyproject.toml's dependencies), less three a one-rank GPU run does not
# import: mpi4py (Horovod's MPI controller, several ranks only), matplotlib (plots, imported on demand) and
# nibabel (BraTS conversion, done before training).
LMS_RUNTIME = ("pyyaml>=6", "psutil>=5.9", "tqdm>=4.66", "nvidia-ml-py>=12")
NOT_BUNDLED_FROM_PYPROJECT = {"mpi4py": "Horovod's MPI controller: several ranks only",
                              "matplotlib": "plots only, imported on demand; the target may have its own",
                              "nibabel": "lms-launch tfrecord --from-brats only: data is converted before training"}
# 64 MiB per device-tool call, minus the repository's working tree (1.0 to 1.24 MiB on 2026-11-24) and
# manifest.json (20 KiB), with room for the tree to grow.
DEFAULT_PART_SIZE = 56 * MiB
MIN_PART_SIZE = 64 << 10
DEFAULT_GLIBC = "2.28"
DEFAULT_OUT = REPO / "bundle"

# Packages that stay out of the bundle even though TensorFlow requires them. For those left out as
# "never loaded", `libdir` is the folder a library would have to search to load them and
# `soname_prefix` their sonames: packing refuses to leave such a package out if any library that stays
# searches that folder (RUNPATH) or needs such a soname (guard_left_out).
@dataclass(frozen=True)
class LeaveOut:
    name: str
    why: str
    libdir: str | None = None
    soname_prefix: str | None = None
    only_with_stubs: bool = False


LEAVE_OUT = (
    LeaveOut("libclang", "Python bindings of clang, used by TensorFlow's build tools; nothing imports it at run time"),
    LeaveOut("nvidia-nccl-cu12", "NCCL: collectives between GPUs; one rank does not use it (Horovod with NCCL "
                                 "needs it: carry it then)"),
    LeaveOut("nvidia-curand-cu12", "no TensorFlow library loads cuRAND (none names its folder or soname)",
             "nvidia/curand/lib", "libcurand.so"),
    LeaveOut("nvidia-cuda-nvrtc-cu12", "no TensorFlow library loads NVRTC from its pip folder (cuDNN's RUNPATH names "
                                       "nvrtc/lib, a folder no wheel makes)", "nvidia/cuda_nvrtc/lib", "libnvrtc.so"),
    LeaveOut("nvidia-nvjitlink-cu12", "nvJitLink: only the real cuFFT, cuSOLVER and cuSPARSE need it, and they are "
                                      "replaced by empty libraries", "nvidia/nvjitlink/lib", "libnvJitLink.so",
             only_with_stubs=True),
)
# TensorFlow opens these when it registers a GPU and a convolutional network never calls them.
STUBBED = ("nvidia/cufft/lib", "nvidia/cusolver/lib", "nvidia/cusparse/lib")
# Removed from the installed tree: nothing at run time reads them.
REMOVE = (
    ("bin", "console scripts, written for this machine's Python"),
    ("tensorflow/include", "TensorFlow's C++ headers, for compiling custom ops"),
)
CUDNN_MEMBERS = ("nvidia/cudnn",)  # plus the nvidia_cudnn_cu12-*.dist-info folder


class BundleError(UsageError):
    """Bad input or an impossible request: exit 2, the message says what to change."""


def say(line: str) -> None:
    print(f"[bundle] {line}", flush=True)


def platform_tags(machine: str, glibc: str) -> list[str]:
    """pip matches --platform tags exactly: every manylinux tag a glibc `glibc` machine accepts."""
    major, minor = (int(x) for x in glibc.split("."))
    if major != 2 or minor < 17:
        raise BundleError(f"--glibc {glibc}: give the target's glibc version, 2.17 or newer (ldd --version)")
    tags = [f"manylinux_2_{n}_{machine}" for n in range(minor, 16, -1)]
    tags += [f"manylinux2014_{machine}", f"manylinux2010_{machine}", f"manylinux1_{machine}"]
    return tags


def pip_target_args(python: str, tags: list[str]) -> list[str]:
    version = "".join(python.split(".")[:2])
    args = ["--only-binary=:all:", "--python-version", ".".join(python.split(".")[:2]), "--implementation", "cp",
            "--abi", f"cp{version}"]
    for tag in tags:
        args += ["--platform", tag]
    return args


def run_pip(pip_python: str, args: list[str], quiet: bool = True) -> None:
    cmd = [pip_python, "-m", "pip"] + args + (["-q"] if quiet else ["--progress-bar", "off"])
    result = subprocess.run(cmd, stdout=None if not quiet else subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        tail = (result.stdout or "")[-3000:]
        raise RuntimeError(f"pip failed ({result.returncode}): {' '.join(cmd[:6])} ...\n{tail}")


@dataclass
class Resolved:
    """The resolver's answer: one entry per distribution, with where to fetch it."""

    candidates: dict[str, havemod.Candidate]
    urls: dict[str, str]
    sha256: dict[str, str | None]


def resolve(pip_python: str, requirements: list[str], target_args: list[str], work: Path) -> Resolved:
    report = work / "resolve.json"
    run_pip(pip_python, ["install", "--dry-run", "--ignore-installed", "--report", str(report)] + target_args
            + requirements)
    doc = json.loads(report.read_text())
    candidates, urls, hashes = {}, {}, {}
    for item in doc["install"]:
        meta = item["metadata"]
        name = canonicalize_name(meta["name"])
        candidates[name] = havemod.Candidate(meta["name"], Version(meta["version"]), tuple(meta.get("requires_dist", [])))
        info = item["download_info"]
        urls[name] = info["url"]
        hashes[name] = (info.get("archive_info", {}).get("hashes") or {}).get("sha256")
    return Resolved(candidates, urls, hashes)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(4 * MiB), b""):
            h.update(block)
    return h.hexdigest()


def fetch(names: list[str], resolved: Resolved, cache: Path, pip_python: str, target_args: list[str]) -> dict[str, Path]:
    """The wheels of `names`, from the cache where a file of the right name and sha256 is there already."""
    cache.mkdir(parents=True, exist_ok=True)
    files, missing = {}, []
    for name in names:
        filename = unquote(Path(urlparse(resolved.urls[name]).path).name)
        path = cache / filename
        files[name] = path
        if path.exists() and (resolved.sha256[name] in (None, _sha256(path))):
            continue
        missing.append(name)
    say(f"download: {len(names) - len(missing)} of {len(names)} wheels already in {cache}; fetching {len(missing)}")
    if missing:
        run_pip(pip_python, ["download", "--no-deps", "-d", str(cache)] + target_args
                + [resolved.urls[n] for n in missing], quiet=False)
    for name in names:
        path = files[name]
        if not path.exists():
            raise RuntimeError(f"pip download did not leave {path.name} in {cache}")
        want = resolved.sha256[name]
        if want and _sha256(path) != want:
            path.unlink()
            raise RuntimeError(f"{path.name}: sha256 differs from the index's; removed it from the cache, run again")
    return files


def tree_size(root: Path) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for f in filenames:
            p = os.path.join(dirpath, f)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total


def make_stubs(site: Path) -> list[dict]:
    """Replaces every shared library under STUBBED by an empty one with its soname."""
    stubs = []
    for rel in STUBBED:
        folder = site / rel
        if not folder.is_dir():
            raise RuntimeError(f"{folder} is missing: the CUDA wheel's layout changed, check STUBBED")
        for lib in sorted(folder.iterdir()):
            if not elf.is_elf(lib):
                continue
            soname = elf.read_dynamic(lib).soname or lib.name
            size = lib.stat().st_size
            elf.build_stub(soname, lib)
            stubs.append({"path": str(lib.relative_to(site)), "soname": soname, "replaced_bytes": size,
                          "bytes": lib.stat().st_size})
    return stubs


DISTUTILS_ALIAS = '''"""Added by lms-launch's bundle packer. TensorFlow 2.18 imports distutils at start-up
(tensorflow/__init__.py), which Python 3.12 no longer has; setuptools supplies it through
distutils-precedence.pth, but Python reads .pth files only in site directories, and this bundle is
put on PYTHONPATH. This module makes `distutils` setuptools' copy, as that .pth file would."""
import importlib
import sys

del sys.modules[__name__]  # setuptools warns about a distutils imported before it
sys.modules[__name__] = importlib.import_module("setuptools._distutils")
'''


def add_distutils_alias(site: Path, python: str) -> dict | None:
    """For Python 3.12 and newer with setuptools in the bundle: a top-level `distutils` (see above)."""
    major, minor = (int(x) for x in python.split(".")[:2])
    if (major, minor) < (3, 12) or not (site / "setuptools" / "_distutils").is_dir() or (site / "distutils").exists():
        return None
    (site / "distutils").mkdir()
    (site / "distutils" / "__init__.py").write_text(DISTUTILS_ALIAS)
    return {"path": "distutils/__init__.py", "why": "TensorFlow 2.18 imports distutils; on Python 3.12 only "
                                                    "setuptools' .pth provides it, and .pth files on PYTHONPATH "
                                                    "are not read"}


def guard_left_out(site: Path, left_out: list[LeaveOut]) -> None:
    """Refuses to leave out a package that a library staying in the bundle could load."""
    watched = [lo for lo in left_out if lo.libdir]
    if not watched:
        return
    problems = []
    for dirpath, _, filenames in os.walk(site):
        for f in filenames:
            path = Path(dirpath) / f
            if path.is_symlink() or not elf.is_elf(path):
                continue
            try:
                dyn = elf.read_dynamic(path)
            except elf.ElfError:
                continue  # executables without a dynamic section, object files
            dirs = {str(d) for d in dyn.search_dirs(path)}
            for lo in watched:
                if str(site / lo.libdir) in dirs:
                    problems.append(f"{path.relative_to(site)} searches {lo.libdir} (its RUNPATH)")
                for needed in dyn.needed:
                    if needed.startswith(lo.soname_prefix):
                        problems.append(f"{path.relative_to(site)} needs {needed} ({lo.name})")
    if problems:
        raise RuntimeError("a library that stays in the bundle could load a package left out:\n  "
                           + "\n  ".join(problems))


def device_calls(bundle_name: str, manifest: Manifest, out_dir: Path) -> str | None:
    """The calls that bring the parts to a machine reached through a tool that runs one command per call
    with at most 64 MiB of files (how lms-launch's GPU figures were made): one part per call."""
    try:
        rel = (out_dir / bundle_name).resolve().relative_to(REPO)
    except ValueError:
        return None
    base, lines = manifest.set("base"), []
    lines += [f"# Device-tool calls for bundle {bundle_name} (docs/gpu-bundle.md explains them)", "",
              "Back to back: the machine forgets /tmp/lms-bundle about 30 s after a call ends.", ""]
    n = len(base.parts)
    for i, part in enumerate(base.parts, 1):
        carry = [f"{rel}/{MANIFEST}", f"{rel}/{part.name}"]
        cmd = f"mkdir -p /tmp/lms-bundle && cp {carry[0]} {carry[1]} /tmp/lms-bundle/ && "
        if i == 1:  # what the machine has, for a have-file with versions (launcher/bundle/targets)
            cmd = "python3 -m pip list --format=freeze > $OUT/target-pip-freeze.txt 2>&1; " + cmd
        if i < n:
            cmd += "python3 launcher/bundle/unpack.py /tmp/lms-bundle --verify-only"
        else:  # unpack, check, then the measurements, most telling first, until the device budget ends
            cmd += SESSION
        lines += [f"{i}. carry {json.dumps(carry)}", f"   command: {cmd}", ""]
    lines += measurement_calls()
    try:
        cudnn = manifest.set("cudnn")
    except KeyError:
        return "\n".join(lines)
    lines += ["Only if the machine's own cuDNN was refused, then, still back to back:", ""]
    for i, part in enumerate(cudnn.parts, 1):
        carry = [f"{rel}/{MANIFEST}", f"{rel}/{part.name}"]
        cmd = f"cp {carry[0]} {carry[1]} /tmp/lms-bundle/ && "
        if i < len(cudnn.parts):
            cmd += "python3 launcher/bundle/unpack.py /tmp/lms-bundle --verify-only"
        else:
            cmd += f"LMS_CUDNN=bundled {SESSION}"
        lines += [f"c{i}. carry {json.dumps(carry)}", f"    command: {cmd}", ""]
    return "\n".join(lines)


# Issue 14 on the GPU: the last transfer call runs benchmarks/gpu_session.sh, which unpacks, checks and
# measures (its stages, most telling first, each with a limit of its own); the bench's two searches
# come after, each in a call of its own (each fills most of a call's 10 minutes).
SESSION = "bash benchmarks/gpu_session.sh /tmp/lms-bundle"
MEASUREMENTS = (f"{SESSION} bench-none", f"{SESSION} bench-lms")


def measurement_calls() -> list[str]:
    lines = ["Then the measurements (issue 14), still back to back, each with `timeout_s` 600; if the device",
             "budget runs out, the next GPU session goes on from the first one missing:", ""]
    for i, command in enumerate(MEASUREMENTS, 1):
        lines += [f"m{i}. carry []", f"    command: {command}", ""]
    return lines


README = """{title}
{underline}

TensorFlow {tf} for CPython {python} on Linux {machine} (glibc {glibc}+), made {created}.
Parts: {base_count} base ({base_size}){cudnn_line}.

On the target machine (no network needed, Python {python} with its standard library only):

  1. Copy manifest.json, unpack.py, manifest.py, check.py and the base-*.part files into one folder.
     Check them there at any time:  python3 unpack.py FOLDER --verify-only
     (or without Python:  sha256sum -c SHA256SUMS --ignore-missing)
  2. python3 unpack.py FOLDER --into DIR
     It refuses missing or damaged parts by name, unpacks into DIR/site-packages, writes DIR/env.sh, and
     checks TensorFlow on the GPU, first with the machine's own cuDNN 9.
  3. If the machine's cuDNN is refused: copy the cudnn-*.part files into FOLDER too and run
     python3 unpack.py FOLDER --into DIR --cudnn bundled
  4. source DIR/env.sh, then run TensorFlow (or lms-launch from its repository) with that python3.

Without Python: cat base-*.part | xz -d | tar -x -C DIR/site-packages  (the same for cudnn-*.part).
"""


def _sets_members(site: Path) -> tuple[list[str], list[str]]:
    cudnn = [m for m in CUDNN_MEMBERS if (site / m).exists()]
    cudnn += sorted(p.name for p in site.glob("nvidia_cudnn_cu*.dist-info"))
    base = sorted(p.name for p in site.iterdir() if p.name not in cudnn and p.name != "nvidia")
    if (site / "nvidia").is_dir():  # a namespace shared by both sets: split below it
        base += sorted(f"nvidia/{p.name}" for p in (site / "nvidia").iterdir() if f"nvidia/{p.name}" not in cudnn)
    return base, cudnn


@dataclass
class Options:
    python: str
    machine: str
    glibc: str
    have: havemod.Have
    have_label: str
    out: Path
    name: str | None
    cache: Path
    part_size: int
    requirements: list[str]
    stubs: bool
    pip_python: str
    threads: int
    chunk: int
    preset: int
    keep_tree: bool
    timings: dict = field(default_factory=dict)


def parse_args(argv: list[str]) -> Options:
    args = parser().parse_args(argv)
    return options_from(args)


def parser() -> UsageParser:
    """`lms-launch bundle`'s options; `lms-launch bundle resplit` has its own (resplit_main)."""
    examples = __doc__[__doc__.index("    lms-launch"):__doc__.index("On a")]
    parser = UsageParser(prog="lms-launch bundle", description=__doc__.split("\n")[0] + "\n\n" + examples,
                         epilog=__doc__[__doc__.index("On a"):])
    parser.add_argument("--python", default="3.12", help="the target's Python, e.g. 3.12 or 3.12.3 (default 3.12)")
    parser.add_argument("--machine", default="x86_64", choices=("x86_64", "aarch64"), help="the target's processor")
    parser.add_argument("--glibc", default=DEFAULT_GLIBC, help=f"the target's glibc (default {DEFAULT_GLIBC})")
    parser.add_argument("--have", default="none",
                        help="what the target has: a `pip list --format=freeze` file, a name under "
                             f"{TARGETS.relative_to(REPO)} (h100-cuda-image), or none (default: carry everything)")
    parser.add_argument("--part-size", default=f"{DEFAULT_PART_SIZE // MiB}MiB",
                        help=f"largest part, e.g. 2GiB where files may be large (default {DEFAULT_PART_SIZE // MiB}MiB, "
                             f"for transfers limited to 64 MiB)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="bundles' folder (default: bundle/ in the repository, git-ignored)")
    parser.add_argument("--name", help="the bundle's folder name (default from TensorFlow, Python, machine, have-file)")
    parser.add_argument("--cache", type=Path, help="wheel cache (default OUT/cache/wheels); reused by later runs")
    parser.add_argument("--requirement", action="append", dest="requirements",
                        help=f"what to bundle instead of the default ({TENSORFLOW} and lms-launch's runtime); repeatable")
    parser.add_argument("--no-stubs", action="store_true", help="carry the real cuFFT, cuSOLVER and cuSPARSE (and nvJitLink)")
    parser.add_argument("--pip-python", default=sys.executable,
                        help="the Python whose pip resolves (default this one; markers are evaluated for --python anyway)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="compression threads")
    parser.add_argument("--chunk", default="64MiB", help="bytes of tar per independent xz stream (default 64MiB)")
    parser.add_argument("--preset", type=int, default=archive.DEFAULT_PRESET, choices=range(0, 10), metavar="0-9",
                        help="xz preset (default 9)")
    parser.add_argument("--keep-tree", action="store_true", help="keep the installed tree (OUT/.work-NAME) for inspection")
    return parser


def options_from(args) -> Options:
    """The parsed options, checked; raises BundleError naming the bad one."""
    try:
        havemod.marker_environment(args.python, args.machine)
    except ValueError as err:
        raise BundleError(f"--python: {err}") from None
    try:
        part_size, chunk = parse_bytes(args.part_size), parse_bytes(args.chunk)
    except ValueError as err:
        raise BundleError(str(err)) from None
    if part_size < MIN_PART_SIZE:
        raise BundleError(f"--part-size {args.part_size}: parts under 64 KiB make thousands of files; give e.g. 56MiB")
    if args.have == "none":
        have, label = havemod.Have({}, "none"), "none"
    else:
        path = Path(args.have)
        if not path.exists() and (TARGETS / f"{args.have}.txt").exists():
            path = TARGETS / f"{args.have}.txt"
        try:
            have = havemod.load_have(path)
        except havemod.HaveError as err:
            raise BundleError(str(err)) from None
        label = path.stem
    if args.name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", args.name):
        raise BundleError(f"--name {args.name!r}: use letters, digits, '.', '_' and '-' (it becomes a folder and "
                          f"part of file paths that tools must carry)")
    if shutil.which(args.pip_python) is None and not Path(args.pip_python).exists():
        raise BundleError(f"--pip-python {args.pip_python}: no such program")
    if not args.no_stubs and shutil.which("gcc") is None:
        raise BundleError("the empty CUDA stand-ins are built with gcc, which is not on PATH: install it "
                          "(apt-get install gcc) or pass --no-stubs")
    out = args.out.resolve()
    return Options(python=args.python, machine=args.machine, glibc=args.glibc, have=have, have_label=label, out=out,
                   name=args.name, cache=(args.cache or out / "cache" / "wheels").resolve(), part_size=part_size,
                   requirements=args.requirements or [TENSORFLOW, *LMS_RUNTIME], stubs=not args.no_stubs,
                   pip_python=args.pip_python, threads=max(1, args.threads), chunk=chunk, preset=args.preset,
                   keep_tree=args.keep_tree)


class Clock:
    """Wall and CPU seconds of a phase: CPU counts this process's threads and its finished children (pip).
    On a shared machine the wall time grows with the load; the CPU time much less."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), self._cpu()

    @staticmethod
    def _cpu() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def record(self, timings: dict, name: str, progress: archive.Progress = say) -> None:
        timings[name] = {"wall_s": round(time.perf_counter() - self.wall, 1), "cpu_s": round(self._cpu() - self.cpu, 1)}
        progress(f"{name}: {timings[name]['wall_s']} s (CPU {timings[name]['cpu_s']} s)")


def sweep(out: Path, name: str) -> None:
    """Removes the temporary folders of earlier runs for `name` that were killed (SIGKILL, power loss)
    before they could clean up; a run still alive keeps its own."""
    pattern = re.compile(rf"^\.(?:work-)?{re.escape(name)}\.pid(\d+)\.")
    for entry in out.iterdir() if out.is_dir() else ():
        m = pattern.match(entry.name)
        if not m or not entry.is_dir():
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # its process is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        say(f"removing {entry.name}, left by a run that was killed")
        shutil.rmtree(entry, ignore_errors=True)


@contextlib.contextmanager
def staging(out: Path, name: str):
    """A temporary folder beside OUT/NAME that replaces it when the block succeeds: a failure or Ctrl-C
    leaves OUT/NAME as it was (absent, or the previous bundle whole)."""
    out.mkdir(parents=True, exist_ok=True)
    final = out / name
    sweep(out, name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.pid{os.getpid()}.", suffix=".partial", dir=out))
    tmp.chmod(0o755)  # mkdtemp makes it private; the bundle is meant to be copied around
    try:
        yield tmp
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{name}.pid{os.getpid()}.", suffix=".old", dir=out))
            os.replace(final, old / name)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def finish(folder: Path, manifest: Manifest, out: Path) -> None:
    """Everything beside the parts: manifest.json, SHA256SUMS, the target-side scripts, README.txt and
    the device-tool calls."""
    (folder / MANIFEST).write_text(manifest.to_json())
    (folder / SUMS).write_text(sums_text(manifest))
    for f in ("unpack.py", "manifest.py", "check.py"):
        shutil.copyfile(HERE / f, folder / f)
    info, base = manifest.info, manifest.set("base")
    cudnn = [s for s in manifest.sets if s.name == "cudnn"]
    cudnn_line = f", {len(cudnn[0].parts)} optional cudnn ({format_bytes(cudnn[0].packed)})" if cudnn else ""
    (folder / "README.txt").write_text(README.format(
        title=f"lms-launch GPU bundle {manifest.name}", underline="=" * len(f"lms-launch GPU bundle {manifest.name}"),
        tf=info.get("tensorflow", "-"),
        python=info.get("python", "-"), machine=info.get("machine", "-"), glibc=info.get("glibc", "-"),
        created=manifest.created, base_count=len(base.parts), base_size=format_bytes(base.packed),
        cudnn_line=cudnn_line))
    calls = device_calls(manifest.name, manifest, out)
    if calls:
        (folder / "DEVICE-CALLS.txt").write_text(calls + "\n")


def report(final: Path, manifest: Manifest, progress: archive.Progress = say) -> None:
    progress(f"bundle written: {final}")
    for s in manifest.sets:
        sizes = ", ".join(format_bytes(p.size) for p in s.parts)
        progress(f"  {s.name}: {len(s.parts)} parts ({sizes}); {format_bytes(s.packed)} packed, "
                 f"{format_bytes(s.unpacked)} as tar, {s.files:,} files")


def write_bundle(site: Path, out: Path, name: str, info: dict, *, part_size: int, chunk: int = archive.DEFAULT_CHUNK,
                 preset: int = archive.DEFAULT_PRESET, threads: int = 1, timings: dict | None = None,
                 progress: archive.Progress = say) -> Path:
    """Packs an installed site-packages tree into OUT/NAME: the base set, the optional cudnn set (when
    the tree has nvidia/cudnn), and what `finish` writes beside them; all or nothing (`staging`)."""
    timings = {} if timings is None else timings
    with staging(out, name) as tmp:
        base_members, cudnn_members = _sets_members(site)
        sets = []
        clock = Clock()
        sets.append(archive.pack_set(site, base_members, tmp, "base", part_size=part_size,
                                     description="TensorFlow, its CUDA 12 libraries but cuDNN, and the Python "
                                                 "packages the target lacks", chunk=chunk, preset=preset,
                                     threads=threads, progress=progress))
        clock.record(timings, "compress base", progress)
        if cudnn_members:
            clock = Clock()
            sets.append(archive.pack_set(site, cudnn_members, tmp, "cudnn", part_size=part_size, optional=True,
                                         description="cuDNN 9 for CUDA 12, for machines whose own cuDNN 9 is "
                                                     "refused", chunk=chunk, preset=preset, threads=threads,
                                         progress=progress))
            clock.record(timings, "compress cudnn", progress)
        created = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        info = {**info, "timings_s": timings,
                "sizes": {**info.get("sizes", {}), **{f"unpacked_{s.name}": s.unpacked for s in sets},
                          **{f"packed_{s.name}": s.packed for s in sets}}}
        manifest = Manifest(name=name, created=created, part_size=part_size, sets=tuple(sets), info=info)
        finish(tmp, manifest, out)
    report(out / name, manifest, progress)
    return out / name


def resplit(bundle: Path, part_size: int, progress: archive.Progress = say) -> Path:
    """Cuts an existing bundle's archives into parts of another size, in seconds: the compressed
    archives stay byte for byte the same (same sha256, same streams), only the parts change."""
    bundle = Path(bundle).resolve()
    manifest = load_manifest(bundle)
    damaged = [f"{n} ({why})" for v in verify(bundle, manifest) for n, why in v.bad] + \
              [n for v in verify(bundle, manifest) for n in v.missing]
    if damaged:
        raise BundleError(f"{bundle}: cannot re-cut, parts missing or damaged: {', '.join(damaged)}")
    with staging(bundle.parent, bundle.name) as tmp:
        sets = tuple(archive.recut(bundle, s, tmp, part_size) for s in manifest.sets)
        manifest = dataclasses.replace(manifest, part_size=part_size, sets=sets)
        finish(tmp, manifest, bundle.parent)
    report(bundle, manifest, progress)
    return bundle


def say_decisions(carried: list, kept: list, left: dict[str, str]) -> None:
    say(f"carried ({len(carried)}):")
    for d in carried:
        say(f"  {d.name} {d.version}: {d.why}")
    say(f"the target's own ({len(kept)}):")
    for d in kept:
        say(f"  {d.name} {d.version or '(version unknown)'}: {d.why}")
    say(f"left out ({len(left)}):")
    for n, why in sorted(left.items()):
        say(f"  {n}: {why}")


def trim(site: Path, opts: Options, left_out: list) -> tuple[list[dict], list[dict], list[dict]]:
    """Removes what TensorFlow does not need on a GPU (REMOVE, CUDA headers), puts empty stand-ins in
    place of the CUDA libraries it only loads, and adds what the target's Python lacks:
    (removed, stand-ins, added), each a record for the manifest."""
    removed = []
    for rel, why in REMOVE:
        if (site / rel).exists():
            size = tree_size(site / rel)
            shutil.rmtree(site / rel)
            removed.append({"path": rel, "bytes": size, "why": why})
    for inc in sorted(p for p in site.glob("nvidia/**/include") if p.is_dir()):
        size = tree_size(inc)
        shutil.rmtree(inc)
        removed.append({"path": str(inc.relative_to(site)), "bytes": size, "why": "CUDA C/C++ headers"})
    stubs = make_stubs(site) if opts.stubs else []
    for s in stubs:
        say(f"  stand-in {s['path']} (soname {s['soname']}): {format_bytes(s['replaced_bytes'])} -> "
            f"{format_bytes(s['bytes'])}")
    guard_left_out(site, left_out)
    added = [a for a in (add_distutils_alias(site, opts.python),) if a]
    for a in added:
        say(f"  added {a['path']}: {a['why']}")
    return removed, stubs, added


def package_records(carried: list, kept: list, left: dict[str, str], wheels: dict[str, Path]) -> dict:
    """The manifest's account of every package: carried (and in which part set), the target's own,
    left out; and the cuDNN version carried, if any."""
    def part_set(d) -> str:
        return "cudnn" if canonicalize_name(d.name) == "nvidia-cudnn-cu12" else "base"

    return {
        "cudnn_version": next((str(d.version) for d in carried if part_set(d) == "cudnn"), None),
        "packages": [{"name": d.name, "version": str(d.version), "why": d.why, "set": part_set(d),
                      "wheel": wheels[canonicalize_name(d.name)].name} for d in carried],
        "from_target": [{"name": d.name, "version": str(d.version) if d.version else None, "why": d.why}
                        for d in kept],
        "left_out": [{"name": n, "why": why} for n, why in sorted(left.items())],
    }


def build(opts: Options) -> Path:
    """Resolves, decides, downloads, installs, trims, and hands the tree to write_bundle."""
    py_tag = "py" + "".join(opts.python.split(".")[:2])
    tf_req = next((r for r in opts.requirements if r.startswith("tensorflow")), opts.requirements[0])
    tf_version = tf_req.split("==")[-1] if "==" in tf_req else "unpinned"
    stem = f"tf{tf_version}" if tf_req.startswith("tensorflow") else "custom"
    name = opts.name or re.sub(r"[^A-Za-z0-9._-]", "_", f"{stem}-{py_tag}-{opts.machine}-{opts.have_label}")
    opts.out.mkdir(parents=True, exist_ok=True)
    sweep(opts.out, name)
    work = Path(tempfile.mkdtemp(prefix=f".work-{name}.pid{os.getpid()}.", dir=opts.out))
    try:
        say(f"bundle {name}: {', '.join(opts.requirements)} for CPython {opts.python} on {opts.machine} "
            f"(glibc {opts.glibc}+), have-file: {opts.have.source}")
        info = install_tree(opts, work / "site-packages", work, tf_version)
        final = write_bundle(work / "site-packages", opts.out, name, info, part_size=opts.part_size, chunk=opts.chunk,
                             preset=opts.preset, threads=opts.threads, timings=opts.timings)
        sizes = info["sizes"]
        say(f"  sizes: wheels {format_bytes(sizes['wheels'])}, installed {format_bytes(sizes['installed'])}, trimmed "
            f"{format_bytes(sizes['trimmed'])}")
        say(f"  timings: {json.dumps(opts.timings)}")
        return final
    finally:
        if opts.keep_tree and work.exists():
            say(f"installed tree kept in {work}")
        elif work.exists():
            shutil.rmtree(work)


def install_tree(opts: Options, site: Path, work: Path, tf_version: str) -> dict:
    """Resolves, decides what to carry, downloads, installs into `site` and trims it; returns the
    manifest's `info` (what was carried and why, the sizes, the phases' times in opts.timings)."""
    tags = platform_tags(opts.machine, opts.glibc)
    target_args = pip_target_args(opts.python, tags)
    left_out = [lo for lo in LEAVE_OUT if opts.stubs or not lo.only_with_stubs]
    clock = Clock()
    resolved = resolve(opts.pip_python, opts.requirements, target_args, work)
    clock.record(opts.timings, "resolve")
    decisions, left = havemod.decide(opts.requirements, resolved.candidates, opts.have,
                                     havemod.marker_environment(opts.python, opts.machine),
                                     {lo.name: lo.why for lo in left_out})
    carried = [d for d in decisions if d.carry]
    kept = [d for d in decisions if not d.carry]
    say_decisions(carried, kept, left)

    clock = Clock()
    wheels = fetch([canonicalize_name(d.name) for d in carried], resolved, opts.cache, opts.pip_python, target_args)
    wheel_bytes = sum(p.stat().st_size for p in wheels.values())
    clock.record(opts.timings, "download")
    say(f"wheels: {len(wheels)}, {format_bytes(wheel_bytes)}")

    clock = Clock()
    say(f"installing {len(wheels)} wheels into {site}")
    run_pip(opts.pip_python, ["install", "--no-deps", "--no-index", "--no-compile", "--target", str(site)]
            + target_args + [str(p) for p in wheels.values()])
    installed = tree_size(site)
    clock.record(opts.timings, "install")
    say(f"installed: {format_bytes(installed)}")

    clock = Clock()
    removed, stubs, added = trim(site, opts, left_out)
    trimmed = tree_size(site)
    clock.record(opts.timings, "trim")
    say(f"trimmed: {format_bytes(trimmed)} (removed {format_bytes(sum(r['bytes'] for r in removed))} of "
        f"headers and scripts, {format_bytes(sum(s['replaced_bytes'] - s['bytes'] for s in stubs))} by stand-ins)")
    return {
        "tensorflow": tf_version, "requirements": opts.requirements, "python": opts.python,
        "machine": opts.machine, "glibc": opts.glibc, "platform_tags": tags, "have_file": opts.have.source,
        "stubs": stubs, "removed": removed, "added": added, **package_records(carried, kept, left, wheels),
        "sizes": {"wheels": wheel_bytes, "installed": installed, "trimmed": trimmed},
        "compression": {"format": "xz", "preset": opts.preset, "chunk": opts.chunk},
        "builder": {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()},
    }


def resplit_main(argv: list[str]) -> int:
    parser = UsageParser(prog="lms-launch bundle resplit",
                         description="Cut a bundle's parts to another size, without rebuilding it.")
    parser.add_argument("bundle", type=Path, help="the bundle's folder (holding manifest.json)")
    parser.add_argument("--part-size", required=True, help="largest part, e.g. 60MiB or 2GiB")
    args = parser.parse_args(argv)
    try:
        part_size = parse_bytes(args.part_size)
    except ValueError as err:
        raise BundleError(str(err)) from None
    if part_size < MIN_PART_SIZE:
        raise BundleError(f"--part-size {args.part_size}: parts under 64 KiB make thousands of files")
    resplit(args.bundle, part_size)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def terminate(signum, frame):  # so that `finally` removes the temporary folders
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminate) if threading_main() else None
    try:
        if argv[:1] == ["resplit"]:
            return resplit_main(argv[1:])
        opts = parse_args(argv)
        build(opts)
        return 0
    except (UsageError, havemod.HaveError, ManifestError) as err:
        print(f"lms-launch bundle: error: {err}", file=sys.stderr)
        return USAGE_STATUS
    except SystemExit as done:  # --help
        return int(done.code or 0)
    except (havemod.ResolveError, RuntimeError, OSError) as err:
        print(f"lms-launch bundle: failed: {err}\n(nothing was written; wheels downloaded so far stay in the cache)",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("lms-launch bundle: interrupted; nothing was written", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
