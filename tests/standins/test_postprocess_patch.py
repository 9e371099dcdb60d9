"""The postprocess_kernel group on the real vLLM + vllm-ascend (NPU runtime stood in).

Order-dependent cases run in fresh interpreters (``run_python``): each installs the stand-ins,
imports in the order under test, and prints what it found at every place.
"""

from __future__ import annotations

import json

import pytest

from ascend_layerwise_patch.kernels.postprocess import PARAMS
from ascend_layerwise_patch.patches import postprocess_kernel as pk

from support import PAIR, run_python

NAMES = ("postprocess_kernel", "postprocess_v2_out_buffer")

PROBE = """
import json
from ascend_layerwise_patch.kernels.postprocess_launch import PostprocessKernel
from ascend_layerwise_patch.patches.postprocess_kernel import kernel_params

def probe():
    import sys
    import ascend_layerwise_patch as alp
    from vllm.v1.worker import mamba_utils
    places = {
        "ascend": "vllm_ascend.ops.triton.mamba.postprocess",
        "vllm": "vllm.v1.worker.mamba_utils",
        "ascend_patch": "vllm_ascend.patch.worker.patch_mamba_utils",
    }
    kernels = {k: getattr(sys.modules.get(m), "postprocess_mamba_fused_kernel", None) for k, m in places.items()}
    v2 = getattr(mamba_utils.MambaSpecDecodeGPUContext, "run_fused_postprocess_align", None)
    print(json.dumps({
        "status": {s.name: [s.state, s.reason] for s in alp.status() if s.name in %r},
        "ours": {k: isinstance(v, PostprocessKernel) for k, v in kernels.items() if v is not None},
        "same": len({id(v) for v in kernels.values() if v is not None}) == 1,
        "params": kernel_params(kernels["vllm"]),
        "v2_tag": getattr(v2, "__ascend_layerwise_patch__", None),
    }))
""" % (NAMES,)

STANDINS = "from ascend_layerwise_patch import cpu_standins; cpu_standins.install()\n"


def run(body: str, env: dict[str, str] | None = None) -> dict:
    proc = run_python(STANDINS + PROBE + body + "\nprobe()\n", env=env)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_in_force(found: dict, *, places: set[str]) -> None:
    """v0251: our kernel everywhere; v0260: vllm-ascend's own kernel (it has the 23 parameters)
    left in place everywhere, the swap reported as fixed upstream. The V2 caller is ours on both."""
    if PAIR == "v0260":
        state, reason = found["status"]["postprocess_kernel"]
        assert state == "skipped" and "fixed upstream" in reason, (state, reason)
        assert found["status"]["postprocess_v2_out_buffer"][0] == "applied", found["status"]
    else:
        for name in NAMES:
            assert found["status"][name][0] == "applied", found["status"]
    assert found["ours"] == {place: PAIR != "v0260" for place in places}, found["ours"]
    assert found["same"], "one kernel object at every place"
    assert found["params"] == list(PARAMS)
    assert found["v2_tag"] == "postprocess_v2_out_buffer"


@pytest.mark.pairs("v0251", "v0260")
def test_activated_first_then_ascend_patch():
    found = run("import ascend_layerwise_patch\nimport vllm_ascend.patch.worker.patch_mamba_utils\n")
    assert_in_force(found, places={"ascend", "vllm", "ascend_patch"})


@pytest.mark.pairs("v0251", "v0260")
@pytest.mark.control("a child that activates with an empty environment of its own (activate({})): not this process's switch")
def test_ascend_patch_first_then_activated():
    """vllm-ascend's patch_mamba_utils already copied its 17-parameter kernel into vLLM when the
    library activates (importing the stand-ins imports the package, so it starts switched off
    and is activated afterwards): applied late, and both copies re-pointed."""
    found = run(
        "import vllm_ascend.patch.worker.patch_mamba_utils\n"
        "import ascend_layerwise_patch as alp\nalp.revert()\nalp.activate({})\n",
        env={"ASCEND_LAYERWISE_PATCH": "0"},
    )
    assert_in_force(found, places={"ascend", "vllm", "ascend_patch"})
    assert "late" in found["status"]["postprocess_kernel" if PAIR != "v0260" else "postprocess_v2_out_buffer"][1]


@pytest.mark.pairs("v0251", "v0260")
def test_vllm_mamba_utils_first_then_ascend_patch():
    """vLLM's module alone triggers the group (its V2 caller is a target); vllm-ascend's patch,
    imported afterwards, copies the kernel it imports -- already ours -- into vLLM."""
    found = run(
        "import ascend_layerwise_patch\nimport vllm.v1.worker.mamba_utils\n"
        "import vllm_ascend.patch.worker.patch_mamba_utils\n"
    )
    assert_in_force(found, places={"ascend", "vllm", "ascend_patch"})


@pytest.mark.pairs("v0250")
def test_vllm_0250_kernel_and_v2_caller():
    """On vLLM 0.25.0, vllm-ascend 0.25.1rc1's patch_mamba_utils does not import; the kernel and
    the V2 caller are still replaced where they live."""
    found = run("import ascend_layerwise_patch\nimport vllm_ascend.ops.triton.mamba.postprocess\n")
    for name in NAMES:
        assert found["status"][name][0] == "applied", found["status"]
    assert found["ours"]["ascend"] is True
    assert found["v2_tag"] == "postprocess_v2_out_buffer"


@pytest.mark.pairs("v0240")
def test_out_of_range_pairs_are_skipped_with_the_reason():
    found = run("import ascend_layerwise_patch\nimport vllm_ascend.ops.triton.mamba.postprocess\n")
    for name in NAMES:
        state, reason = found["status"][name]
        assert state == "skipped" and "version out of range" in reason, (name, state, reason)
    assert found["ours"] == {"ascend": False, "vllm": False}
    assert found["v2_tag"] is None


@pytest.mark.pairs("v0251", "v0250", "v0260")
@pytest.mark.control("the group's detectors run on the shipped, unwrapped kernel: the same whether the library applied or not")
def test_detectors_on_the_real_objects():
    """Precondition and fixed-upstream checks against the shipped code, not look-alikes."""
    import importlib

    ascend = importlib.import_module("vllm_ascend.ops.triton.mamba.postprocess")
    from vllm.v1.worker import mamba_utils

    kernel = ascend.postprocess_mamba_fused_kernel
    original = getattr(kernel, "__wrapped__", kernel)  # the group may have applied in this process
    if PAIR == "v0260":  # vllm-ascend 0.26.0rc1 ships vLLM's 23-parameter kernel: fixed upstream
        assert pk.kernel_params(original) == list(PARAMS)
        assert "23 parameters" in pk._ascend_has_new_signature(original)
        assert pk._old_kernel(original) is not None
    else:
        assert pk.kernel_params(original) == pk.OLD_PARAMS
        assert pk._old_kernel(original) is None
        assert pk._ascend_has_new_signature(original) is None
    caller = mamba_utils.MambaSpecDecodeGPUContext.run_fused_postprocess_align
    caller = getattr(caller, "__wrapped__", caller)
    assert pk._v2_caller_as_expected(caller) is None
    assert pk._v2_caller_passes_out(caller) is None
    # our own kernel has the 23 parameters vLLM 0.25 passes: it would count as "fixed upstream"
    assert pk._ascend_has_new_signature(pk.shared_kernel()) is not None
    assert pk._old_kernel(pk.shared_kernel()) is not None


@pytest.mark.control("the import's own cost, whether the library activates or not")
def test_importing_the_patch_module_is_light():
    proc = run_python(
        "import sys\nimport ascend_layerwise_patch.patches.postprocess_kernel as pk\n"
        "pk.shared_kernel()\n"
        "print(sorted(m for m in ('torch', 'triton', 'vllm', 'vllm_ascend') if m in sys.modules))\n"
    )
    assert proc.stdout.strip().splitlines()[-1] == "[]"
