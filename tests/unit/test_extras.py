"""The wheel's ``vllm`` extra (setup.cfg) is the vLLM range the groups are declared for
(``patches._ranges.SUPPORTED``), and it admits exactly the vLLM of each supported pair of
scripts/pairs.txt: those where some patch is expected in range (scripts/expected_states.txt)."""

from __future__ import annotations

import configparser

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from support import ROOT, expected_states

from ascend_layerwise_patch.patches import _ranges


def extras() -> dict[str, str]:
    """setup.cfg's ``[options.extras_require]``: extra -> its requirement line."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return dict(cfg["options.extras_require"])


def supported_pairs() -> dict[str, bool]:
    """Each pair of scripts/pairs.txt: whether any patch is expected in range there."""
    table = expected_states()
    pairs, states = table.load()
    return {pair: any(codes[pair] != "range" for codes in states.values()) for pair in pairs}


def problems(extra: str) -> list[str]:
    """Where the ``vllm`` extra's requirement line disagrees with the named ranges and the pairs."""
    req = Requirement(extra)
    found = []
    if req.name != "vllm":
        found.append(f"the extra requires {req.name}, not vllm")
    if req.specifier != SpecifierSet(_ranges.SUPPORTED.vllm):
        found.append(f"the extra's range {req.specifier} is not _ranges.SUPPORTED's {_ranges.SUPPORTED.vllm}")
    versions = expected_states().pair_versions()
    for pair, supported in supported_pairs().items():
        vllm = versions[pair][0]
        if req.specifier.contains(Version(vllm), prereleases=True) != supported:
            found.append(f"{pair}: the extra {'refuses' if supported else 'admits'} vLLM {vllm}")
    return found


def test_the_vllm_extra_is_the_supported_range():
    assert problems(extras()["vllm"]) == []


def test_every_supported_pair_is_admitted_by_the_named_ranges():
    versions = expected_states().pair_versions()
    for pair, supported in supported_pairs().items():
        vllm, ascend = (Version(Version(v).base_version) for v in versions[pair])
        admitted = SpecifierSet(_ranges.SUPPORTED.vllm).contains(vllm) and SpecifierSet(_ranges.SUPPORTED.vllm_ascend).contains(ascend)
        assert admitted == supported, pair


def test_a_wrong_extra_is_found():
    # the extra before issue 35: vLLM 0.29 / 0.30 refused by the wheel the README installs there
    found = problems("vllm>=0.25.0,<0.27")
    assert found[0] == f"the extra's range <0.27,>=0.25.0 is not _ranges.SUPPORTED's {_ranges.SUPPORTED.vllm}"
    assert {"v0300: the extra refuses vLLM 0.30.0", "v0290: the extra refuses vLLM 0.29.0"} <= set(found[1:])
    assert "v0240: the extra admits vLLM 0.24.0" in problems("vllm>=0.24,<0.31,!=0.27.*,!=0.28.*")
    assert problems("vllm-ascend" + _ranges.SUPPORTED.vllm)[0] == "the extra requires vllm-ascend, not vllm"


def test_pyproject_declares_no_other_extras():
    assert "optional-dependencies" not in (ROOT / "pyproject.toml").read_text()
