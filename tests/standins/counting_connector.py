"""A real KVConnectorBase_V1 that counts layers like AscendStore's pool worker does."""

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


class LayerCountingConnector(KVConnectorBase_V1):
    """Every wait and save advances ``current_layer``; ``calls`` keeps their order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.current_layer = 0
        self.calls: list[tuple[str, str]] = []

    def start_load_kv(self, forward_context, **kwargs):
        self.current_layer = 0

    def wait_for_layer_load(self, layer_name):
        self.calls.append(("wait", layer_name))
        self.current_layer += 1

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        self.calls.append(("save", layer_name))
        self.current_layer += 1

    def wait_for_save(self):
        pass

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()


def install():
    """Register with vLLM's factory, create it the way vLLM does, make it the transfer group.

    Returns ``(connector, vllm_config, restore)``.
    """
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    name = LayerCountingConnector.__name__
    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, __name__, name)
    config = VllmConfig(kv_transfer_config=KVTransferConfig(kv_connector=name, kv_role="kv_both"))
    connector = KVConnectorFactory.create_connector(config=config, role=KVConnectorRole.WORKER, kv_cache_config=None)
    previous = kv_transfer_state._KV_CONNECTOR_AGENT
    kv_transfer_state._KV_CONNECTOR_AGENT = connector  # what ensure_kv_transfer_initialized sets

    def restore():
        kv_transfer_state._KV_CONNECTOR_AGENT = previous

    return connector, config, restore
