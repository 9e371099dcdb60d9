"""The benchmark scripts as the matrix runs them (issue 13, points 10 and 11): ``fetch`` keeps the
two kernel files and no wheel, and smoke runs say their numbers are not judged. No vLLM needed."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

from support import ROOT

BENCH = ROOT / "scripts" / "bench_postprocess.py"


def fake_wheel(folder, dist: str, version: str, member: str) -> None:
    """A minimal, valid wheel holding one file (stands in for the vLLM / vllm-ascend wheels)."""
    name = dist.replace("-", "_")
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as zf:
        zf.writestr(member, "# kernel file\n")
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")


def test_fetch_keeps_the_kernel_files_and_no_wheel(tmp_path):
    wheels, bench = tmp_path / "wheels", tmp_path / "bench"
    wheels.mkdir()
    fake_wheel(wheels, "vllm", "0.25.1", "vllm/v1/worker/mamba_utils.py")
    fake_wheel(wheels, "vllm-ascend", "0.25.1rc1", "vllm_ascend/ops/triton/mamba/postprocess.py")
    (bench / "wheels").mkdir(parents=True)
    (bench / "wheels" / "old-0.1-py3-none-any.whl").write_bytes(b"kept by an older fetch")
    env = {**os.environ, "ALP_BENCH_DIR": str(bench), "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(BENCH), "fetch", "--find-links", str(wheels), "--no-index"],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in bench.rglob("*")) == ["ascend_postprocess.py", "vllm_mamba_utils.py"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench", "wheels"]  # no temporary folder left
    assert "(wheel not kept)" in proc.stdout


def test_smoke_runs_say_their_numbers_are_not_judged():
    """The notes are printed by the scripts themselves and by matrix.sh's smoke step."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_postprocess
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert "not judged" in bench_postprocess.SMOKE_NOTE
    matrix = (ROOT / "scripts" / "matrix.sh").read_text()
    assert 'echo "=== smoke: $name (does it run? interpreter / CPU timings and ratios are not judged)"' in matrix
    assert "are not judged" in (ROOT / "scripts" / "bench_hotpath.py").read_text()
