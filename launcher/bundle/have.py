"""What the target machine already has, and which of the runtime's packages must be carried to it.

A have-file lists the target's Python packages as `pip list --format=freeze` writes them: `name==version`
per line; a bare `name` (or `name @ url`) means present, version unknown. The decision, per package
the runtime needs:

- not on the target: carried;
- on the target at a known version that satisfies every requirement on it: the target's is used;
- at a known version that does not satisfy them (numpy 2.5 where TensorFlow wants < 2.1): carried;
- version unknown and something constrains it: carried, since it cannot be shown to fit;
- version unknown and nothing constrains it (`packaging`, required with no specifier): the target's.

Requirements count only from packages that are carried: a package the target keeps brings its own,
already-installed dependencies. Markers are evaluated for the target's Python and platform, not this
machine's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version


class HaveError(ValueError):
    """A have-file line that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Have:
    """Target packages: canonical name -> version, or None where present with the version unknown."""

    packages: dict[str, Version | None]
    source: str = "have-file"

    def has(self, name: str) -> bool:
        return canonicalize_name(name) in self.packages

    def version(self, name: str) -> Version | None:
        return self.packages.get(canonicalize_name(name))


def parse_have(text: str, source: str = "have-file") -> Have:
    packages: dict[str, Version | None] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):  # comments, blank lines, `-e ...` editable installs
            continue
        if " @ " in line:
            line = line.split(" @ ", 1)[0].strip()
        name, sep, version = line.partition("==")
        name = name.strip()
        try:
            Requirement(name)  # a valid distribution name
        except InvalidRequirement:
            raise HaveError(f"{source}, line {number}: {raw.strip()!r} is not `name==version` or `name`") from None
        if any(c in name for c in "<>=!~[;"):
            raise HaveError(f"{source}, line {number}: {raw.strip()!r}: write `name==version` (pip list "
                            f"--format=freeze) or a bare name")
        parsed = None
        if sep:
            try:
                parsed = Version(version.strip())
            except InvalidVersion:
                raise HaveError(f"{source}, line {number}: {version.strip()!r} is not a version") from None
        packages[canonicalize_name(name)] = parsed
    return Have(packages, source)


def load_have(path: Path) -> Have:
    try:
        return parse_have(Path(path).read_text(), str(path))
    except FileNotFoundError:
        raise HaveError(f"have-file {path} does not exist; write one with `python3 -m pip list --format=freeze` "
                        f"on the target, or pass --have none for a target with nothing") from None


def marker_environment(python: str, machine: str = "x86_64") -> dict[str, str]:
    """PEP 508 marker values for CPython `python` ('3.12' or '3.12.3') on Linux `machine`."""
    numbers = python.split(".")
    if len(numbers) < 2 or not all(n.isdigit() for n in numbers):
        raise ValueError(f"{python!r} is not a Python version like 3.12 or 3.12.3")
    full = ".".join(numbers + ["0"] * (3 - len(numbers)))
    return {"implementation_name": "cpython", "implementation_version": full, "os_name": "posix",
            "platform_machine": machine, "platform_python_implementation": "CPython", "platform_release": "",
            "platform_system": "Linux", "platform_version": "", "python_full_version": full,
            "python_version": ".".join(numbers[:2]), "sys_platform": "linux"}


@dataclass(frozen=True)
class Candidate:
    """A distribution the resolver chose for the target: name, version, and its Requires-Dist."""

    name: str
    version: Version
    requires: tuple[str, ...] = ()


@dataclass(frozen=True)
class Decision:
    name: str
    version: Version | None
    """The version carried, or the target's (None when unknown)."""
    carry: bool
    why: str
    wanted: str
    """Every specifier on it from the carried packages, joined ('' when none)."""
    by: tuple[str, ...]
    """The carried packages (or 'requested') that need it."""


@dataclass
class _Need:
    specifiers: list[SpecifierSet] = field(default_factory=list)
    extras: set[str] = field(default_factory=set)
    by: list[str] = field(default_factory=list)


class ResolveError(RuntimeError):
    """The resolver's answer lacks a package the target needs, or picked a version that does not fit."""


def decide(roots: list[str], candidates: dict[str, Candidate], have: Have, env: dict[str, str],
           leave_out: dict[str, str] | None = None) -> tuple[list[Decision], dict[str, str]]:
    """Decides, for every package reachable from `roots` through carried packages, whether to carry it.

    `candidates` maps canonical names to the resolver's choice. `leave_out` maps canonical names to the
    reason they stay out of the bundle even when required. Returns the decisions (sorted by name) and
    the left-out packages that were in fact required (name -> reason)."""
    leave_out = {canonicalize_name(k): v for k, v in (leave_out or {}).items()}
    needs: dict[str, _Need] = {}
    left: dict[str, str] = {}

    def add(requirement: str, by: str, extras: tuple[str, ...]) -> None:
        req = Requirement(requirement)
        if req.marker is not None and not _marker_true(req.marker, env, extras):
            return
        name = canonicalize_name(req.name)
        if name in leave_out:
            left[name] = leave_out[name]
            return
        need = needs.setdefault(name, _Need())
        need.specifiers.append(req.specifier)
        need.extras |= set(req.extras)
        need.by.append(by)

    for root in roots:
        add(root, "requested", ())
    expanded: dict[str, frozenset[str]] = {}
    decisions: dict[str, Decision] = {}
    while True:
        changed = False
        for name in sorted(needs):
            need = needs[name]
            decision = _decide_one(name, need, candidates, have)
            decisions[name] = decision
            if decision.carry and expanded.get(name) != frozenset(need.extras):
                # a carried package's own requirements now count (again, if extras were added)
                expanded[name] = frozenset(need.extras)
                for requirement in candidates[name].requires:
                    add(requirement, candidates[name].name, tuple(sorted(need.extras)))
                changed = True
        if not changed:
            break
    return [decisions[n] for n in sorted(decisions)], left


def _marker_true(marker: Marker, env: dict[str, str], extras: tuple[str, ...]) -> bool:
    return any(marker.evaluate({**env, "extra": extra}) for extra in (extras or ("",)))


def _decide_one(name: str, need: _Need, candidates: dict[str, Candidate], have: Have) -> Decision:
    spec = SpecifierSet()
    for s in need.specifiers:
        spec &= s
    wanted = str(spec)
    by = tuple(dict.fromkeys(need.by))
    target_has, target_version = have.has(name), have.version(name)

    def carried(why: str) -> Decision:
        candidate = candidates.get(name)
        if candidate is None:
            raise ResolveError(f"{name} (needed by {', '.join(by)}) is not in the resolver's answer for the "
                               f"target's Python: resolve with that Python (--pip-python)")
        if not spec.contains(candidate.version, prereleases=True):
            raise ResolveError(f"the resolver chose {name} {candidate.version}, which does not satisfy {wanted} "
                               f"(from {', '.join(by)}): resolve with the target's Python (--pip-python)")
        return Decision(candidate.name, candidate.version, True, why, wanted, by)

    if not target_has:
        return carried("not on the target")
    if target_version is not None:
        if spec.contains(target_version, prereleases=True):
            return Decision(name, target_version, False, f"target has {target_version}", wanted, by)
        return carried(f"target has {target_version}, needs {wanted}")
    if wanted:
        return carried(f"target has it, version unknown; needs {wanted}")
    return Decision(name, None, False, "target has it, and nothing constrains its version", wanted, by)
