"""Installed versions, read from package metadata (never by importing the package).

Classification rule: a version is compared on its *base release*, so a pre-release, a dev build
or a local build counts as the release it leads to:

    0.25.1rc1, 0.25.1.dev12+g54503ec, 0.25.1+cpu, 0.25.1.post2  ->  0.25.1

That is what a user of vllm-ascend expects (its releases are all ``rcN`` pre-releases, and vLLM
built from a checkout carries ``.devN+gSHA``), and it keeps ``>=0.25.0,<0.27`` from admitting
``0.27.1rc1`` or a ``0.27.0.dev`` build. Range checks never decide alone: every patch also checks
that its target still looks the way it expects (its precondition), so a pre-release whose code
drifted is refused by that check rather than by the version number.
"""

from __future__ import annotations

from typing import NamedTuple

#: distribution name -> short key used in specs and status records
DISTRIBUTIONS = {"vllm": "vllm", "vllm-ascend": "vllm_ascend"}


class Installed(NamedTuple):
    """The detected version of one distribution (``raw`` is ``None`` when absent)."""

    dist: str
    raw: str | None

    @property
    def base(self):
        return base_release(self.raw)

    def __str__(self) -> str:
        return self.raw if self.raw is not None else "not installed"


def base_release(raw: str | None):
    """``packaging.version.Version`` of the base release, or ``None`` (absent or not PEP 440)."""
    from packaging.version import InvalidVersion, Version  # lazy: kept off the import path

    if raw is None:
        return None
    try:
        return Version(Version(raw).base_version)
    except InvalidVersion:
        return None


def installed(dist: str) -> Installed:
    import importlib.metadata  # lazy: kept off the import path

    try:
        return Installed(dist, importlib.metadata.version(dist))
    except importlib.metadata.PackageNotFoundError:
        return Installed(dist, None)


def detect() -> dict[str, Installed]:
    """Versions of vLLM and vllm-ascend, keyed by ``vllm`` / ``vllm_ascend``."""
    return {key: installed(dist) for dist, key in DISTRIBUTIONS.items()}


def in_range(inst: Installed, spec: str) -> tuple[bool, str]:
    """Whether ``inst`` satisfies the PEP 440 ``spec`` on its base release, and why not."""
    from packaging.specifiers import SpecifierSet

    base = inst.base
    if inst.raw is None:
        return False, f"{inst.dist} is not installed"
    if base is None:
        return False, f"{inst.dist} {inst.raw} is not a PEP 440 version"
    if SpecifierSet(spec).contains(base, prereleases=True):
        return True, ""
    shown = inst.raw if str(base) == inst.raw else f"{inst.raw} (base {base})"
    return False, f"{inst.dist} {shown} is outside {spec}"
