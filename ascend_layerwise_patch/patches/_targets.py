"""Target paths that several groups share (each group's own targets stay in its module)."""

#: vllm-ascend's layerwise KV pool (AscendStore): pool_scheduler, pool_worker, kv_transfer, ...
STORE = "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store"
#: vLLM's process-wide KV transfer group (``has_kv_transfer_group`` / ``get_kv_transfer_group``)
STATE = "vllm.distributed.kv_transfer.kv_transfer_state"
