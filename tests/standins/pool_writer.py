"""Run by another pair's venv (issue 25: a pool written by one release pair, read by another).

    python pool_writer.py OUT MODEL_DIR NONE_HASH_HEX [TP KV_HEADS]

On the pool harness, one instance of the tiny hybrid in MODEL_DIR serves the reader's prompt A
(``A`` below) once with the library off and once with it on; each pool's ready keys are saved to
``OUT.off`` / ``OUT.on`` (``byte_store.save``). NONE_HASH_HEX is the reader's ``NONE_HASH`` (block
hashes agree across processes as they do in a fleet sharing ``PYTHONHASHSEED``).
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
A = list(range(1000, 1040))


def main(out: str, model_dir: str, none_hash: str, tp: int = 1, kv_heads: int = 2) -> None:
    sys.path[:0] = [HERE]
    from ascend_layerwise_patch import cpu_standins

    cpu_standins.install()
    import ascend_layerwise_patch
    import byte_store
    import harness_pool

    harness_pool.set_none_hash(bytes.fromhex(none_hash))
    reg = ascend_layerwise_patch.REGISTRY
    for lib in ("off", "on"):
        reg.revert()
        if lib == "on":
            reg.activate()
        pool = harness_pool.make_pool()
        inst = harness_pool.PoolInstance(pool, name=f"writer-{lib}", tp=tp, kv_heads=kv_heads, model_dir=model_dir)
        inst.add_request("a", A)
        harness_pool.engine_loop(inst)
        print(f"{lib}: {byte_store.save(pool, f'{out}.{lib}')} keys")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:6]))
