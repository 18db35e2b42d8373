"""The offline GPU bundle (launcher/bundle): packing into parts, the manifest's checks, refusing missing
and damaged parts by name, reassembly, the have-list decision, the stand-ins' sonames, and that a
failure never leaves a half-written bundle. No network: trees are synthetic, wheels never fetched."""
from __future__ import annotations

import hashlib
import io
import json
import lzma
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest
from packaging.version import Version

from launcher.bundle import archive, elf, manifest as bm, pack, unpack
from launcher.bundle.check import TOLERANCE, compare, numpy_conv_same
from launcher.bundle.have import Candidate, Have, HaveError, ResolveError, decide, marker_environment, parse_have

REPO = Path(__file__).resolve().parent.parent
KiB = 1024
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


def make_tree(root: Path) -> dict[str, bytes]:
    """A site-packages-like tree: incompressible and compressible files, an executable, a symlink, a
    cudnn folder for the optional set. Returns relative path -> contents for the regular files."""
    rng = __import__("random").Random(7)
    files = {
        "pkg/__init__.py": b"VALUE = 1\n",
        "pkg/data.bin": bytes(rng.getrandbits(8) for _ in range(300 * KiB)),
        "pkg/text.txt": b"tensor " * 40000,
        "pkg/sub/deep/lib.so": bytes(rng.getrandbits(8) for _ in range(120 * KiB)),
        "tool/bin/ptxas": b"#!/bin/sh\necho ptxas\n",
        "nvidia/__init__.py": b"",
        "nvidia/cublas/lib/libcublas.so.12": bytes(rng.getrandbits(8) for _ in range(90 * KiB)),
        "nvidia/cudnn/lib/libcudnn.so.9": bytes(rng.getrandbits(8) for _ in range(150 * KiB)),
        "nvidia_cudnn_cu12-9.3.0.75.dist-info/METADATA": b"Name: nvidia-cudnn-cu12\n",
        "other-1.0.dist-info/METADATA": b"Name: other\n",
    }
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (root / "tool/bin/ptxas").chmod(0o755)
    (root / "pkg/link.so").symlink_to("sub/deep/lib.so")
    return files


def pack_small(site: Path, folder: Path, part_size: int = 100 * KiB, members=("pkg", "tool", "nvidia/cublas"),
               **kw) -> bm.PartSet:
    folder.mkdir(parents=True, exist_ok=True)
    return archive.pack_set(site, list(members), folder, "base", part_size=part_size, chunk=128 * KiB, preset=1,
                            threads=2, **kw)


def small_manifest(part_set: bm.PartSet, *more: bm.PartSet) -> bm.Manifest:
    return bm.Manifest(name="test", created="2026-11-24", part_size=100 * KiB, sets=(part_set, *more))


# --- packing and reassembly ---------------------------------------------------------------------------

def test_parts_have_the_given_size_and_hashes(tmp_path):
    site = tmp_path / "site"
    make_tree(site)
    s = pack_small(site, tmp_path / "out")
    on_disk = [tmp_path / "out" / p.name for p in s.parts]
    sizes = [p.stat().st_size for p in on_disk]
    total = sum(sizes)
    assert len(s.parts) == math.ceil(total / (100 * KiB)) >= 3
    assert all(n == 100 * KiB for n in sizes[:-1]) and 0 < sizes[-1] <= 100 * KiB
    assert [p.size for p in s.parts] == sizes
    for part, path in zip(s.parts, on_disk):
        assert hashlib.sha256(path.read_bytes()).hexdigest() == part.sha256
    whole = b"".join(p.read_bytes() for p in on_disk)
    assert hashlib.sha256(whole).hexdigest() == s.archive_sha256
    assert sum(st.packed for st in s.streams) == total
    n = len(s.parts)
    assert [p.name for p in s.parts] == [f"base-{i:02d}-of-{n:02d}.part" for i in range(1, n + 1)]
    assert not list((tmp_path / "out").glob(".*")), "no temporary part files left behind"


def test_streams_are_independent_xz_and_the_whole_is_one_tar(tmp_path):
    """Each stream decompresses alone (the target does them in parallel); concatenated, the parts are a
    plain .tar.xz that `xz -d | tar -x` reads, holding exactly the source files."""
    site = tmp_path / "site"
    files = make_tree(site)
    s = pack_small(site, tmp_path / "out")
    whole = b"".join((tmp_path / "out" / p.name).read_bytes() for p in s.parts)
    offset, tar_bytes = 0, b""
    for st in s.streams:
        raw = lzma.decompress(whole[offset:offset + st.packed], format=lzma.FORMAT_XZ)
        assert len(raw) == st.unpacked
        tar_bytes += raw
        offset += st.packed
    assert all(st.unpacked == 128 * KiB for st in s.streams[:-1])
    assert lzma.decompress(whole) == tar_bytes
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        names = {m.name for m in tar.getmembers() if m.isreg()}
        assert names == {r for r in files if r.startswith(("pkg/", "tool/", "nvidia/cublas/"))}
        for name in names:
            assert tar.extractfile(name).read() == files[name]
        assert tar.getmember("pkg/link.so").issym()
        assert s.files == len(names)


def test_reassembly_is_byte_identical_to_the_parts_concatenated(tmp_path):
    site = tmp_path / "site"
    make_tree(site)
    s = pack_small(site, tmp_path / "out")
    out = bm.reassemble(tmp_path / "out", s, tmp_path / "archive.tar.xz")
    concatenated = b"".join((tmp_path / "out" / p.name).read_bytes() for p in s.parts)
    assert out.read_bytes() == concatenated
    if shutil.which("xz") and shutil.which("tar"):
        dest = tmp_path / "by-tar"
        dest.mkdir()
        subprocess.run(f"xz -dc {out} | tar -x -C {dest}", shell=True, check=True)
        assert (dest / "pkg/data.bin").read_bytes() == (site / "pkg/data.bin").read_bytes()


def test_extract_restores_files_modes_and_links(tmp_path):
    site = tmp_path / "site"
    files = make_tree(site)
    s = pack_small(site, tmp_path / "out")
    dest = tmp_path / "dest"
    unpack.extract_set(tmp_path / "out", s, dest, threads=2)
    for rel in ("pkg/data.bin", "pkg/text.txt", "pkg/sub/deep/lib.so", "tool/bin/ptxas"):
        assert (dest / rel).read_bytes() == files[rel]
    assert os.access(dest / "tool/bin/ptxas", os.X_OK)
    assert os.readlink(dest / "pkg/link.so") == "sub/deep/lib.so"
    assert not (dest / "nvidia/cudnn").exists()


def test_part_names_sort_in_order():
    """`cat base-*.part` must concatenate in order, also past 99 parts."""
    for count in (9, 18, 120):
        names = [bm.part_name("base", i, count) for i in range(1, count + 1)]
        assert sorted(names) == names
        assert bm.parse_part_name(names[-1]) == ("base", count, count)
    assert bm.part_name("cudnn", 7, 120) == "cudnn-007-of-120.part"


def test_manifest_json_round_trip_and_bad_manifests(tmp_path):
    site = tmp_path / "site"
    make_tree(site)
    m = small_manifest(pack_small(site, tmp_path / "out"))
    assert bm.Manifest.from_json(m.to_json()) == m
    with pytest.raises(bm.ManifestError, match="not valid JSON"):
        bm.Manifest.from_json(m.to_json()[:-20])
    with pytest.raises(bm.ManifestError, match="not an lms-launch"):
        bm.Manifest.from_json(json.dumps({"format": "something else"}))
    doc = json.loads(m.to_json())
    del doc["sets"][0]["parts"][0]["sha256"]
    with pytest.raises(bm.ManifestError):
        bm.Manifest.from_json(json.dumps(doc))
    with pytest.raises(bm.ManifestError, match="no manifest.json"):
        bm.load(tmp_path / "nowhere")


# --- refusing missing and damaged parts ---------------------------------------------------------------

@pytest.fixture
def bundle_dir(tmp_path):
    """A folder as the target sees it: manifest.json and the parts of a base and a cudnn set."""
    site = tmp_path / "site"
    make_tree(site)
    folder = tmp_path / "parts"
    base = pack_small(site, folder)
    cudnn = archive.pack_set(site, ["nvidia/cudnn", "nvidia_cudnn_cu12-9.3.0.75.dist-info"], folder, "cudnn",
                             part_size=100 * KiB, optional=True, chunk=128 * KiB, preset=1, threads=2)
    m = small_manifest(base, cudnn)
    (folder / bm.MANIFEST).write_text(m.to_json())
    return folder, m


def test_verify_all_good(bundle_dir):
    folder, m = bundle_dir
    result = bm.verify(folder, m)
    assert [v.complete for v in result] == [True, True]
    assert result[0].good == tuple(p.name for p in m.set("base").parts)


def test_missing_part_is_refused_by_name(bundle_dir, tmp_path, capsys):
    folder, m = bundle_dir
    gone = m.set("base").parts[1].name
    (folder / gone).unlink()
    v = bm.verify(folder, m, ["base"])[0]
    assert v.missing == (gone,) and not v.bad and not v.complete
    into = tmp_path / "tf"
    assert unpack.main([str(folder), "--into", str(into), "--no-check"]) == 2
    err = capsys.readouterr().err
    assert gone in err and "Nothing was unpacked" in err
    assert not into.exists() and not list(tmp_path.glob(".tf.*"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend"])
def test_corrupted_part_is_refused_by_name(bundle_dir, tmp_path, capsys, damage):
    folder, m = bundle_dir
    victim = folder / m.set("base").parts[0].name
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncate":
        del data[-1]
    else:
        data += b"\0"
    victim.write_bytes(bytes(data))
    v = bm.verify(folder, m, ["base"])[0]
    assert [name for name, _ in v.bad] == [victim.name] and not v.missing
    assert ("sha256" if damage == "flip" else "bytes") in v.bad[0][1]
    into = tmp_path / "tf"
    assert unpack.main([str(folder), "--into", str(into), "--no-check"]) == 2
    assert victim.name in capsys.readouterr().err
    assert not into.exists()
    # --verify-only, used after each transfer, refuses it too
    assert unpack.main([str(folder), "--verify-only"]) == 2


def test_verify_only_accepts_a_partial_folder(bundle_dir, capsys):
    folder, m = bundle_dir
    for p in m.set("base").parts[1:]:
        (folder / p.name).unlink()
    assert unpack.main([str(folder), "--verify-only"]) == 0
    out = capsys.readouterr().out
    n = len(m.set("base").parts)
    assert f"base: 1 of {n} parts here and intact" in out and "base set complete: no" in out


def test_unpack_and_bundled_cudnn(bundle_dir, tmp_path):
    folder, m = bundle_dir
    into = tmp_path / "tf"
    assert unpack.main([str(folder), "--into", str(into), "--no-check", "--cudnn", "bundled"]) == 0
    site = into / unpack.SITE
    assert (site / "pkg/data.bin").read_bytes() == (tmp_path / "site/pkg/data.bin").read_bytes()
    assert (site / "nvidia/cudnn/lib/libcudnn.so.9").read_bytes() == \
        (tmp_path / "site/nvidia/cudnn/lib/libcudnn.so.9").read_bytes()
    assert (site / "nvidia/cublas/lib/libcublas.so.12").exists()
    env = (into / unpack.ENV_FILE).read_text()
    assert f"export PYTHONPATH={site}" in env and "LD_LIBRARY_PATH" not in env
    # run twice: same build, nothing unpacked again, the tree is still whole
    assert unpack.main([str(folder), "--into", str(into), "--no-check", "--cudnn", "bundled"]) == 0
    assert (site / "nvidia/cudnn/lib/libcudnn.so.9").exists()


def test_unpack_refuses_a_foreign_folder(bundle_dir, tmp_path, capsys):
    folder, _ = bundle_dir
    into = tmp_path / "home"
    into.mkdir()
    (into / "precious.txt").write_text("keep me")
    assert unpack.main([str(folder), "--into", str(into), "--no-check"]) == 2
    assert "holds no unpacked bundle" in capsys.readouterr().err
    assert (into / "precious.txt").read_text() == "keep me" and not (into / unpack.SITE).exists()


def test_unpacker_runs_standalone_with_the_standard_library(bundle_dir, tmp_path):
    """On the target nothing is installed: unpack.py and manifest.py copied beside the parts must work
    alone, in an isolated Python (-I: no PYTHONPATH, no site-packages of the user, not the repo)."""
    folder, m = bundle_dir
    for f in ("unpack.py", "manifest.py", "check.py"):
        shutil.copyfile(REPO / "launcher/bundle" / f, folder / f)
    run = lambda *a: subprocess.run([sys.executable, "-I", str(folder / "unpack.py"), *a], capture_output=True,
                                    text=True, cwd=tmp_path)
    r = run(str(folder), "--verify-only")
    assert r.returncode == 0, r.stderr
    assert f"base: {len(m.set('base').parts)} of {len(m.set('base').parts)} parts here and intact" in r.stdout
    r = run(str(folder), "--into", str(tmp_path / "tf"), "--no-check", "--cudnn", "bundled")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "tf" / unpack.SITE / "pkg/text.txt").exists()
    (folder / m.set("cudnn").parts[0].name).unlink()
    r = run(str(folder), "--into", str(tmp_path / "tf2"), "--no-check", "--cudnn", "bundled")
    assert r.returncode == 2 and m.set("cudnn").parts[0].name in r.stderr


# --- nothing half-written -----------------------------------------------------------------------------

def test_failed_pack_leaves_the_previous_bundle_whole(tmp_path):
    site = tmp_path / "site"
    make_tree(site)
    out = tmp_path / "bundles"
    quiet = lambda line: None
    first = pack.write_bundle(site, out, "b", {"python": "3.12"}, part_size=100 * KiB, chunk=128 * KiB, preset=1,
                              threads=2, progress=quiet)
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    assert {"manifest.json", "SHA256SUMS", "unpack.py", "manifest.py", "check.py"} <= set(before)
    assert any(n.startswith("cudnn-") for n in before) and any(n.startswith("base-") for n in before)

    def interrupt(line: str) -> None:
        if "compressed" in line:  # after the first parts are written
            raise KeyboardInterrupt

    (site / "pkg/new.bin").write_bytes(os.urandom(200 * KiB))
    with pytest.raises(KeyboardInterrupt):
        pack.write_bundle(site, out, "b", {"python": "3.12"}, part_size=100 * KiB, chunk=128 * KiB, preset=1,
                          threads=2, progress=interrupt)
    assert {p.name: p.read_bytes() for p in (out / "b").iterdir()} == before
    assert sorted(p.name for p in out.iterdir()) == ["b"], "no temporary folders left"
    with pytest.raises(KeyboardInterrupt):
        pack.write_bundle(site, out, "fresh", {}, part_size=100 * KiB, chunk=128 * KiB, preset=1, threads=2,
                          progress=interrupt)
    assert not (out / "fresh").exists()


def test_sha256sums_file_checks_with_sha256sum(tmp_path):
    site = tmp_path / "site"
    make_tree(site)
    b = pack.write_bundle(site, tmp_path / "out", "b", {}, part_size=100 * KiB, chunk=128 * KiB, preset=1,
                          threads=2, progress=lambda line: None)
    lines = (b / bm.SUMS).read_text().splitlines()
    m = bm.load(b)
    assert len(lines) == sum(len(s.parts) for s in m.sets)
    if shutil.which("sha256sum"):
        assert subprocess.run(["sha256sum", "-c", "--quiet", bm.SUMS], cwd=b).returncode == 0


# --- what the target has ------------------------------------------------------------------------------

ENV312 = marker_environment("3.12")


def cands(**pins: tuple[str, list[str]]) -> dict[str, Candidate]:
    return {name.replace("_", "-"): Candidate(name.replace("_", "-"), Version(v), tuple(reqs))
            for name, (v, reqs) in pins.items()}


TF_LIKE = cands(
    tf=("2.18.1", ["numpy<2.1.0,>=1.26.0", "protobuf<6.0.0dev,>=3.20.3", "packaging", "ml-dtypes<1.0.0,>=0.4.0",
                   "gcsfs>=0.23.1; python_version < '3.12'", "cublas==12.5; extra == 'and-cuda'", "libclang>=13"]),
    numpy=("2.0.2", []), protobuf=("5.29.6", []), packaging=("26.3", []), ml_dtypes=("0.6.0", ["numpy>=1.21"]),
    gcsfs=("0.37.1", []), cublas=("12.5", []), libclang=("18.1.1", []),
)


def by_name(decisions):
    return {d.name: d for d in decisions}


def test_have_decisions_on_hand_written_specifiers():
    have = parse_have("numpy==2.5.2\nprotobuf\npackaging\nml_dtypes==0.5.1\n# a comment\n")
    decisions, left = decide(["tf[and-cuda]==2.18.1"], TF_LIKE, have, ENV312, {"libclang": "not needed"})
    d = by_name(decisions)
    assert d["tf"].carry and d["tf"].why == "not on the target"
    assert d["numpy"].carry and "2.5.2" in d["numpy"].why and d["numpy"].version == Version("2.0.2")
    assert d["protobuf"].carry and "version unknown" in d["protobuf"].why
    assert not d["packaging"].carry and d["packaging"].version is None
    assert not d["ml-dtypes"].carry and d["ml-dtypes"].version == Version("0.5.1")
    assert d["cublas"].carry  # the extra was requested
    assert "gcsfs" not in d  # python_version < 3.12 is false for the target, whatever this Python is
    assert left == {"libclang": "not needed"} and "libclang" not in d


def test_the_h100s_own_package_list_keeps_what_fits_and_carries_what_does_not():
    """The machine's `pip list`, brought back by the first device call (2026-11-27), against the
    TensorFlow-like requirements above: its numpy 2.5.2 and protobuf 7.36.2 break `<2.1` and `<6`, so
    both are carried; its ml-dtypes 0.6.0 and packaging 26.3 satisfy them and are kept."""
    have = parse_have((REPO / "launcher/bundle/targets/h100-cuda-image-pip-freeze.txt").read_text())
    d = by_name(decide(["tf[and-cuda]==2.18.1"], TF_LIKE, have, ENV312, {"libclang": "not needed"})[0])
    assert d["numpy"].carry and d["protobuf"].carry and "7.36.2" in d["protobuf"].why
    assert not d["ml-dtypes"].carry and d["ml-dtypes"].version == Version("0.6.0")
    assert not d["packaging"].carry and d["packaging"].version == Version("26.3")


def test_markers_follow_the_target_python_and_extras():
    d311 = by_name(decide(["tf==2.18.1"], TF_LIKE, Have({}), marker_environment("3.11.9"))[0])
    assert "gcsfs" in d311 and "cublas" not in d311  # no [and-cuda]: no CUDA wheels
    assert marker_environment("3.12.3")["python_full_version"] == "3.12.3"
    assert marker_environment("3.12")["python_full_version"] == "3.12.0"


def test_requirements_count_only_from_carried_packages():
    """A package the target keeps brings its own installed dependencies; a package carried later can
    still add a constraint that makes another one carried."""
    c = cands(app=("1.0", ["rich", "lib"]), rich=("15.0", ["pygments>=2.13"]), pygments=("2.21", []),
              lib=("2.0", ["helper"]), helper=("3.0", ["rich>=14"]))
    have = parse_have("rich\npygments==2.0\nhelper\n")
    d = by_name(decide(["app"], c, have, ENV312)[0])
    assert d["lib"].carry and not d["helper"].carry  # helper: present, unconstrained
    # rich is constrained by nobody carried (helper is the target's): the target's is used, and its
    # dependency pygments is not examined at all
    assert not d["rich"].carry and "pygments" not in d
    c["lib"] = Candidate("lib", Version("2.0"), ("helper>=3",))
    d = by_name(decide(["app"], c, have, ENV312)[0])
    assert d["helper"].carry and d["rich"].carry and d["pygments"].carry
    assert "2.0" in d["pygments"].why and d["rich"].wanted == ">=14"


def test_name_normalisation_and_have_file_errors():
    have = parse_have("Typing_Extensions==4.1.0\nfoo @ file:///x/foo.whl\n-e git+https://x#egg=bar\n")
    assert have.version("typing-extensions") == Version("4.1.0") and have.has("foo") and not have.has("bar")
    c = cands(typing_extensions=("4.16.0", []))
    d = by_name(decide(["typing_extensions>=4.10"], c, have, ENV312)[0])
    assert d["typing-extensions"].carry
    with pytest.raises(HaveError, match="line 2"):
        parse_have("numpy==2.0\nnumpy>=1.26\n")
    with pytest.raises(HaveError, match="not a version"):
        parse_have("numpy==two\n")


def test_resolver_gaps_are_errors():
    with pytest.raises(ResolveError, match="missing-one"):
        decide(["missing-one>=1"], {}, Have({}), ENV312)
    with pytest.raises(ResolveError, match="does not satisfy"):
        decide(["a", "b"], cands(a=("1", ["c<2"]), b=("1", []), c=("2.5", [])), Have({}), ENV312)


def test_h100_have_file_parses_and_keeps_numpy_out():
    have = parse_have((REPO / "launcher/bundle/targets/h100-cuda-image.txt").read_text())
    assert have.version("numpy") == Version("2.5.2") and have.version("torch") == Version("2.11.0")
    assert have.has("protobuf") and have.version("protobuf") is None
    assert not have.has("tensorflow") and not have.has("keras") and not have.has("optree")


def test_bundled_runtime_follows_pyproject():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    from packaging.requirements import Requirement

    names = {Requirement(d).name for d in deps}
    bundled = {Requirement(r).name for r in pack.LMS_RUNTIME}
    assert bundled | set(pack.NOT_BUNDLED_FROM_PYPROJECT) == names - {"numpy"}


def test_platform_tags_for_a_glibc():
    tags = pack.platform_tags("x86_64", "2.28")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags
    assert "manylinux2014_x86_64" in tags and "manylinux_2_29_x86_64" not in tags
    with pytest.raises(pack.BundleError):
        pack.platform_tags("x86_64", "2.5")


# --- shared libraries ---------------------------------------------------------------------------------

def readelf_dynamic(path: Path) -> dict[str, list[str]]:
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    found: dict[str, list[str]] = {}
    for line in out.splitlines():
        for kind in ("SONAME", "NEEDED", "RUNPATH", "RPATH"):
            if f"({kind})" in line:
                found.setdefault(kind, []).append(line.split("[", 1)[1].rsplit("]", 1)[0])
    return found


@needs_gcc
@pytest.mark.parametrize("soname", ["libcufft.so.11", "libcusolverMg.so.11", "libcusparse.so.12"])
def test_stub_carries_the_soname(tmp_path, soname):
    stub = elf.build_stub(soname, tmp_path / "lib" / soname)
    assert elf.read_dynamic(stub).soname == soname
    assert stub.stat().st_size < 64 * KiB
    if shutil.which("readelf"):
        assert readelf_dynamic(stub)["SONAME"] == [soname]


@needs_gcc
def test_dynamic_section_parser_agrees_with_readelf(tmp_path):
    src = tmp_path / "a.c"
    src.write_text("int f(void) { return 1; }\n")
    lib = tmp_path / "liba.so.3"
    subprocess.run(["gcc", "-shared", "-o", str(lib), str(src), "-Wl,-soname,liba.so.3", "-Wl,--enable-new-dtags",
                    "-Wl,-rpath,$ORIGIN/../x/lib:$ORIGIN", "-Wl,--no-as-needed", "-lm"], check=True)
    dyn = elf.read_dynamic(lib)
    assert dyn.soname == "liba.so.3" and "libm.so.6" in dyn.needed
    assert dyn.runpath == ("$ORIGIN/../x/lib", "$ORIGIN")
    assert dyn.search_dirs(lib) == (tmp_path.parent / "x/lib", tmp_path)  # $ORIGIN is tmp_path
    if shutil.which("readelf"):
        ref = readelf_dynamic(lib)
        assert ref["SONAME"] == [dyn.soname] and ref["NEEDED"] == list(dyn.needed)
        assert ref["RUNPATH"] == [":".join(dyn.runpath)]
    with pytest.raises(elf.ElfError):
        elf.read_dynamic(src)


@needs_gcc
def test_guard_refuses_leaving_out_a_reachable_library(tmp_path):
    site = tmp_path / "site"
    libdir = site / "tensorflow"
    libdir.mkdir(parents=True)
    src = tmp_path / "t.c"
    src.write_text("int g(void) { return 2; }\n")
    lo = pack.LeaveOut("nvidia-curand-cu12", "unused", "nvidia/curand/lib", "libcurand.so")
    subprocess.run(["gcc", "-shared", "-o", str(libdir / "libtf.so"), str(src), "-Wl,--enable-new-dtags",
                    "-Wl,-rpath,$ORIGIN/../nvidia/cublas/lib"], check=True)
    pack.guard_left_out(site, [lo])  # nothing names curand: fine
    subprocess.run(["gcc", "-shared", "-o", str(libdir / "libtf2.so"), str(src), "-Wl,--enable-new-dtags",
                    "-Wl,-rpath,$ORIGIN/../nvidia/curand/lib"], check=True)
    with pytest.raises(RuntimeError, match="libtf2.so searches nvidia/curand/lib"):
        pack.guard_left_out(site, [lo])


@needs_gcc
def test_machine_cudnn_is_chosen_by_version(tmp_path, monkeypatch):
    """A library answering cudnnGetVersion like cuDNN 9.13 (CUDA 13 build) is tried first; one like 9.1
    is refused, since TensorFlow 2.18 was built with 9.3. (The real cuDNN needs a GPU machine.)"""
    def fake(version: int, folder: Path) -> Path:
        folder.mkdir()
        src = folder / "v.c"
        src.write_text(f"#include <stddef.h>\nsize_t cudnnGetVersion(void) {{ return {version}; }}\n"
                       "size_t cudnnGetCudartVersion(void) { return 13000; }\n")
        subprocess.run(["gcc", "-shared", "-o", str(folder / "libcudnn.so.9"), str(src),
                        "-Wl,-soname,libcudnn.so.9"], check=True)
        return folder

    m = bm.Manifest("t", "x", 1, (), {"cudnn_version": "9.3.0.75"})
    into = tmp_path / "tf"
    monkeypatch.setenv("CUDNN_PATH", str(fake(91300, tmp_path / "new")))
    attempts = unpack._cudnn_choice("auto", m, into)
    assert attempts[0][0] == "machine" and attempts[0][1] == (tmp_path / "new").resolve()
    assert "9.13.0" in attempts[0][2] and "CUDA 13.0" in attempts[0][2]
    assert attempts[-1][0] == "bundled"
    monkeypatch.setenv("CUDNN_PATH", str(fake(90100, tmp_path / "old")))
    attempts = unpack._cudnn_choice("auto", m, into)
    assert [a[0] for a in attempts] == ["bundled"]
    with pytest.raises(unpack.UnpackError, match="no usable cuDNN"):
        unpack._cudnn_choice("machine", m, into)


def test_environment_sets_the_paths(tmp_path):
    env = unpack.environment(tmp_path, None, {"PYTHONPATH": "/x"})
    assert env["PYTHONPATH"] == f"{tmp_path / 'site-packages'}:/x" and "LD_LIBRARY_PATH" not in env
    env = unpack.environment(tmp_path, Path("/opt/cudnn/lib"), {"LD_LIBRARY_PATH": "/usr/local/nvidia/lib64"})
    assert env["LD_LIBRARY_PATH"] == "/opt/cudnn/lib:/usr/local/nvidia/lib64"
    assert env["CUDA_CACHE_MAXSIZE"] == "4294967296"


def test_bundled_cudnn_is_not_shadowed_by_another_on_the_library_path(tmp_path):
    """LD_LIBRARY_PATH is searched before TensorFlow's RUNPATH: a folder there with a libcudnn.so.9
    would be loaded instead of the bundle's, so the bundled choice leaves such folders out."""
    other = tmp_path / "cuda/lib64"
    other.mkdir(parents=True)
    (other / "libcudnn.so.9").write_bytes(b"")
    search = f"/usr/local/nvidia/lib64:{other}"
    drop = tuple(unpack.cudnn_dirs_in(search))
    assert drop == (str(other),)
    env = unpack.environment(tmp_path, None, {"LD_LIBRARY_PATH": search}, drop=drop)
    assert env["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib64"


def test_numpy_reference_convolution_by_hand():
    import numpy as np

    x = np.arange(1, 10, dtype=np.float32).reshape(1, 3, 3, 1)
    w = np.ones((3, 3, 1, 1), np.float32)
    out = numpy_conv_same(x, w)[0, :, :, 0]
    # SAME padding with a 3x3 box filter: centre sums all nine (45), a corner its 2x2 block
    assert out[1, 1] == 45 and out[0, 0] == 1 + 2 + 4 + 5 and out[2, 2] == 5 + 6 + 8 + 9 and out[0, 1] == 1 + 2 + 3 + 4 + 5 + 6


def test_device_calls_send_one_part_each_then_unpack():
    parts = lambda s, n: tuple(bm.Part(bm.part_name(s, i, n), 10, "0" * 64) for i in range(1, n + 1))
    m = bm.Manifest("b", "x", 10, (bm.PartSet("base", False, "", parts("base", 3), (), "", 0),
                                   bm.PartSet("cudnn", True, "", parts("cudnn", 2), (), "", 0)))
    text = pack.device_calls("b", m, REPO / "bundle")
    carries = [json.loads(line.split("carry ", 1)[1]) for line in text.splitlines() if " carry [" in line]
    carries = [c for c in carries if c]  # the measurements carry nothing: TensorFlow is unpacked by then
    assert carries == [["bundle/b/manifest.json", f"bundle/b/{p.name}"] for s in m.sets for p in s.parts]
    commands = [line.split("command: ", 1)[1] for line in text.splitlines() if "command: " in line]
    assert all("--verify-only" in c for c in commands[0:2] + commands[-2:-1])
    # The last base call unpacks, checks and measures (benchmarks/gpu_session.sh), with the machine's cuDNN
    # first; the last cudnn call does the same with the bundled one.
    assert commands[2].endswith("&& bash benchmarks/gpu_session.sh /tmp/lms-bundle")
    assert commands[-1].endswith("&& LMS_CUDNN=bundled bash benchmarks/gpu_session.sh /tmp/lms-bundle")
    # Between the base set and the cudnn set: the bench's searches, in the TensorFlow the base call unpacked.
    assert commands[3:5] == ["bash benchmarks/gpu_session.sh /tmp/lms-bundle bench-none",
                             "bash benchmarks/gpu_session.sh /tmp/lms-bundle bench-lms"]
    session = (REPO / "benchmarks" / "gpu_session.sh").read_text()
    assert all(f"{stage})" in session for stage in ("unpack", "bench-none", "bench-lms"))
    copies = [c for c in commands if "/tmp/lms-bundle/" in c]
    assert all(f"cp {c[0]} {c[1]} /tmp/lms-bundle/" in cmd for c, cmd in zip(carries, copies))
    assert pack.device_calls("b", m, Path("/elsewhere")) is None  # outside the repository: no device tool


def test_a_killed_runs_leftovers_are_swept_and_a_live_ones_kept(tmp_path):
    out = tmp_path / "bundles"
    dead = out / ".b.pid999999999.x1.partial"  # above any pid_max: that process cannot exist
    alive = out / f".work-b.pid{os.getpid()}.x2"
    other = out / ".c.pid999999999.x3.partial"  # another bundle's: not ours to judge
    for d in (dead, alive, other):
        d.mkdir(parents=True)
    site = tmp_path / "site"
    make_tree(site)
    pack.write_bundle(site, out, "b", {}, part_size=100 * KiB, chunk=128 * KiB, preset=1, threads=2,
                      progress=lambda line: None)
    assert not dead.exists() and alive.exists() and other.exists()


def test_resplit_keeps_the_archive_and_cuts_new_parts(tmp_path, capsys):
    site = tmp_path / "site"
    make_tree(site)
    b = pack.write_bundle(site, tmp_path / "out", "b", {}, part_size=100 * KiB, chunk=128 * KiB, preset=1,
                          threads=2, progress=lambda line: None)
    before = bm.load(b)
    whole = lambda m, s: b"".join((b / p.name).read_bytes() for p in m.set(s).parts)
    archives = {s.name: whole(before, s.name) for s in before.sets}
    assert pack.main(["resplit", str(b), "--part-size", "64KiB"]) == 0
    after = bm.load(b)
    for s in after.sets:
        assert whole(after, s.name) == archives[s.name]
        assert s.archive_sha256 == before.set(s.name).archive_sha256 and s.streams == before.set(s.name).streams
        assert len(s.parts) == math.ceil(len(archives[s.name]) / (64 * KiB))
        assert all(p.size == 64 * KiB for p in s.parts[:-1])
    assert all(v.complete for v in bm.verify(b, after))
    assert sorted(p.name for p in b.glob("*.part")) == sorted(p.name for s in after.sets for p in s.parts)
    # a damaged part stops it, by name, and the bundle stays as it was
    victim = b / after.set("base").parts[0].name
    victim.write_bytes(b"x" + victim.read_bytes()[1:])
    assert pack.main(["resplit", str(b), "--part-size", "100KiB"]) == 2
    assert victim.name in capsys.readouterr().err and bm.load(b) == after


def test_distutils_alias_for_python_312(tmp_path):
    """TensorFlow 2.18 runs `import distutils`; on Python 3.12 only setuptools' .pth supplies it, and .pth
    files on PYTHONPATH are never read. The alias makes `distutils` setuptools' copy."""
    site = tmp_path / "site"
    (site / "setuptools/_distutils").mkdir(parents=True)
    (site / "setuptools/__init__.py").write_text("")
    (site / "setuptools/_distutils/__init__.py").write_text("FROM_SETUPTOOLS = True\n")
    (site / "setuptools/_distutils/sysconfig.py").write_text("def get_python_lib():\n    return 'here'\n")
    assert pack.add_distutils_alias(site, "3.11") is None and not (site / "distutils").exists()
    assert pack.add_distutils_alias(site, "3.12")["path"] == "distutils/__init__.py"
    code = ("import distutils, distutils.sysconfig, sys; "
            "print(distutils.FROM_SETUPTOOLS, distutils.sysconfig.get_python_lib(), sys.modules['distutils'] is distutils)")
    r = subprocess.run([sys.executable, "-s", "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(site)}, cwd=tmp_path)
    assert r.stdout.split() == ["True", "here", "True"], r.stderr
    assert pack.add_distutils_alias(site, "3.12") is None  # there already: left alone


def test_comparison_judges_against_the_outputs_scale():
    import numpy as np

    want = np.array([[100.0, -50.0], [0.0, 1e-9]])
    assert compare(want + 1e-6 * 100, want)["ok"]  # rounding-sized everywhere, even on the tiny entry
    off = want.copy()
    off[1, 1] = 100 * TOLERANCE * 2  # one wrong entry, twice the tolerance of the scale (100)
    e = compare(off, want)
    assert not e["ok"] and e["relative"] == pytest.approx(2 * TOLERANCE)
    assert not compare(np.array([[np.nan, 0], [0, 0]]), want)["ok"]
