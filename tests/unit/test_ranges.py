"""The version ranges of the groups that cover vLLM 0.25 / 0.26 (a version check never decides alone:
each group also checks its target's shape, see tests/standins)."""

from __future__ import annotations

import pytest

from ascend_layerwise_patch import versions
from ascend_layerwise_patch.patches import connector_guards, gdn_layerwise, mamba_lifetime, postprocess_kernel

SPECS = (*connector_guards.SPECS, *gdn_layerwise.SPECS, *mamba_lifetime.SPECS, *postprocess_kernel.SPECS)


@pytest.mark.parametrize(
    "vllm,ascend,admitted",
    [
        ("0.25.0", "0.25.1rc1", True),
        ("0.25.1", "0.25.1rc1", True),
        ("0.26.0", "0.26.0rc1", True),
        ("0.26.0.dev7+g1234abc", "0.26.0rc1", True),
        ("0.24.0", "0.24.0rc1", False),
        ("0.25.1", "0.24.0rc1", False),
        ("0.27.0", "0.26.0rc1", False),
        ("0.27.1", "0.27.1rc1", False),
        ("0.27.0.dev3+gabc", "0.27.0rc1", False),
    ],
)
def test_ranges(vllm, ascend, admitted):
    for spec in SPECS:
        ok_vllm, _ = versions.in_range(versions.Installed("vllm", vllm), spec.requires["vllm"])
        ok_ascend, _ = versions.in_range(versions.Installed("vllm-ascend", ascend), spec.requires["vllm_ascend"])
        assert (ok_vllm and ok_ascend) is admitted, (spec.name, spec.requires)
