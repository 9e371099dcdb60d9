"""Target paths that several groups share (each group's own targets stay in its module), and what
several groups read off the targets' objects."""

#: vllm-ascend's layerwise KV pool (AscendStore): pool_scheduler, pool_worker, kv_transfer, ...
STORE = "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store"
#: vLLM's process-wide KV transfer group (``has_kv_transfer_group`` / ``get_kv_transfer_group``)
STATE = "vllm.distributed.kv_transfer.kv_transfer_state"


def save_keys(tasks) -> list[str]:
    """The pool keys a layer sending thread's item saves: its tasks' ``shared_block_data.save_keys``,
    first seen first, once each."""
    keys: dict[str, None] = {}
    for task in tasks:
        shared = getattr(task, "shared_block_data", None)
        if shared is not None and shared.save_keys:
            keys.update(dict.fromkeys(shared.save_keys))
    return list(keys)
