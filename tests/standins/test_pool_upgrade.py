"""Issue 25: a pool written by vllm-ascend 0.26.0rc1 or 0.25.1rc1 (the v0260 / v0251 pairs' venvs, with
this library off and on) is read by vllm-ascend 0.30.0rc2 with 0 wrong reads.

The writer (pool_writer.py) runs in the writer pair's venv next to this one (``.matrix/<pair>``): the pool
harness there serves prompt A (40 tokens) and saves the pool's ready keys; here a fresh 0.30 instance
of the same checkpoint folder (keys name it) loads that pool and serves A's first 32 tokens + 5: a
32-token pool hit. Library-off pool: 0.25/0.26 keys have 0.30's upstream shape
(``model@group@hash@rank``) and at one TP size the same bytes -- with ``pool_key_tp`` off the hit is
taken and read right; with it on (keys name the TP size) the old keys miss and the prompt recomputes.
Library-on pool: ``pool_key_layout`` versioned its keys, 0.30 never hits them either way.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ascend_layerwise_patch
from support import PAIR

PAIRS = ("v0300",)
if PAIR not in PAIRS:
    pytest.skip(f"for pairs {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

import byte_store  # noqa: E402
import harness_pool  # noqa: E402
from harness_pool import PoolInstance, engine_loop  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
A = list(range(1000, 1040))
#: writer pair -> the release its pool is labelled with
WRITERS = {"v0260": "0.26", "v0251": "0.25"}


def _writer_python(pair: str) -> Path | None:
    """The writer pair's interpreter: a sibling of this pair's venv (``.matrix/<pair>``)."""
    here = Path(sys.prefix)
    for venv in (here.parent / pair, ROOT / ".matrix" / pair):
        if (venv / "bin" / "python").exists():
            return venv / "bin" / "python"
    return None


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_pool_written_by_older_release_is_read_right_by_030(tmp_path, writer):
    python = _writer_python(writer)
    if python is None:
        pytest.skip(f"no {writer} venv next to this one (scripts/env.sh {writer}; the whole matrix builds every pair first)")
    old = WRITERS[writer]
    from vllm.v1.core import kv_cache_utils

    harness_pool.set_none_hash()
    model_dir = harness_pool.checkpoint_dir("GAGA", 2, folder="qwen3next-upgrade")
    out = tmp_path / "pool"
    env_path = str(ROOT)
    proc = subprocess.run(
        [str(python), str(HERE / "pool_writer.py"), str(out), model_dir, bytes(kv_cache_utils.NONE_HASH).hex()],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": env_path, "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {}
    reg = ascend_layerwise_patch.REGISTRY
    try:
        for reader in ("key groups off", "library on"):
            reg.revert()
            # pool_key_layout too: its 0.30 member names the layout in every key
            key_groups = "pool_key_tp,pool_key_layout"
            reg.activate(environ={**os.environ, "ASCEND_LAYERWISE_PATCH_SKIP": key_groups} if "off" in reader else None)
            for lib in ("off", "on"):
                pool = byte_store.load(f"{out}.{lib}")
                inst = PoolInstance(pool, name=f"reader-{lib}", model_dir=model_dir)
                inst.add_request("b", A[:32] + [7, 8, 9, 10, 11])
                engine_loop(inst)
                reads = inst.reads_of("b") + inst.reads_of("b", kind="attn")
                rows[f"{old} library {lib} -> 0.30 {reader}"] = (sum(not r.ok for r in reads), len(reads), len(pool.key_bytes[byte_store.G2L]))
    finally:
        reg.revert()
        reg.activate()
    print(f"\n{writer} pool read by 0.30.0rc2: (wrong reads, reads, keys loaded)")
    for name, row in rows.items():
        print(f"  {name}: {row}")
    assert all(wrong == 0 for wrong, _reads, _loaded in rows.values()), rows
    assert rows[f"{old} library off -> 0.30 key groups off"][2] > 0  # same key shape: hit taken, read right
    assert rows[f"{old} library off -> 0.30 library on"][2] == 0  # keys naming the TP size: the old ones miss
    assert rows[f"{old} library on -> 0.30 library on"][2] == rows[f"{old} library on -> 0.30 key groups off"][2] == 0
