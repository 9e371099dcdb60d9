"""The README's operator recipe against the real vLLM / vllm-ascend (issue 13, point 7): its
``vllm serve`` line parses with vLLM's own ``serve`` argument parser into vLLM's real
``KVTransferConfig``, and what that config names exists in vllm-ascend."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from support import ROOT


def serve_line() -> str:
    lines = [line.strip() for line in (ROOT / "README.md").read_text().splitlines() if line.strip().startswith("vllm serve ")]
    assert len(lines) == 1, lines
    return lines[0]


def test_readme_kv_transfer_config_builds_vllms_config():
    from vllm.config import KVTransferConfig

    argv = shlex.split(serve_line())
    doc = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    config = KVTransferConfig(**doc)
    assert (config.kv_connector, config.kv_role) == ("AscendStoreConnector", "kv_both")
    assert config.kv_connector_extra_config == {"backend": "memcache", "use_layerwise": True}


@pytest.mark.pairs("v0251", "v0250")
def test_readme_serve_line_parses_and_names_what_vllm_ascend_has():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.entrypoints.openai.cli_args import make_arg_parser

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older vLLM
        from vllm.utils import FlexibleArgumentParser

    argv = shlex.split(serve_line())
    assert argv[:2] == ["vllm", "serve"]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[2:])
    assert isinstance(args.kv_transfer_config, KVTransferConfig)
    assert args.mamba_cache_mode == "align"

    import vllm_ascend
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store import ascend_store_connector
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend import backend_map

    if "AscendStoreConnector" not in KVConnectorFactory._registry:  # vllm-ascend's plugin registers once
        vllm_ascend.register_connector()
    assert args.kv_transfer_config.kv_connector in KVConnectorFactory._registry
    extra = args.kv_transfer_config.kv_connector_extra_config
    assert extra["backend"] in backend_map
    source = open(ascend_store_connector.__file__).read()
    for key in extra:
        assert re.search(rf"extra_config\.get\(\s*\"{key}\"", source), key  # a key the connector reads

    # VLLM_PLUGINS, as the README sets it, names vllm-ascend's platform and general plugins and ours.
    from importlib.metadata import entry_points

    readme = (ROOT / "README.md").read_text()
    plugins = re.search(r"export VLLM_PLUGINS=(\S+)", readme).group(1).split(",")
    known = {ep.name for group in ("vllm.general_plugins", "vllm.platform_plugins") for ep in entry_points(group=group)}
    assert "ascend_layerwise_patch" in plugins and "ascend" in plugins and set(plugins) <= known, (plugins, known)
