"""The operator recipe against the real vLLM / vllm-ascend (issue 13, point 7): the README's
``vllm serve`` line parses with vLLM's own ``serve`` argument parser into vLLM's real
``KVTransferConfig``, and what that config names exists in vllm-ascend; docs/install.md's check
blocks keep check's exit code on the pair."""

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


@pytest.mark.control("the README's config read by vLLM's own parser: no patch involved")
def test_readme_kv_transfer_config_builds_vllms_config():
    from vllm.config import KVTransferConfig

    argv = shlex.split(serve_line())
    doc = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    config = KVTransferConfig(**doc)
    assert (config.kv_connector, config.kv_role) == ("AscendStoreConnector", "kv_both")
    assert config.kv_connector_extra_config == {"backend": "memcache", "use_layerwise": True}
    assert config.kv_load_failure_policy == "recompute"  # issue 36: the README's own advice (vLLM's default: fail)


def _literals(tp) -> set:
    """Every string a (nested) ``Literal`` / union annotation allows."""
    import typing

    args = typing.get_args(tp)
    return {tp} if isinstance(tp, str) else set().union(*map(_literals, args)) if args else set()


@pytest.mark.control("the README's config read by vLLM's own parser: no patch involved")
def test_readme_speculative_config_names_vllms_mtp_method():
    """Issue 36 / 33: the seed's MTP config, with a method this pair's vLLM knows (model-independent
    fields only: the draft model is read from the checkpoint at start-up)."""
    import dataclasses

    from vllm.config import SpeculativeConfig

    argv = shlex.split(serve_line())
    doc = json.loads(argv[argv.index("--speculative-config") + 1])
    assert doc == {"method": "qwen3_5_mtp", "num_speculative_tokens": 3}
    fields = {f.name: f for f in dataclasses.fields(SpeculativeConfig)}
    assert set(doc) <= set(fields)
    method = fields["method"].type
    if isinstance(method, str):  # postponed annotations
        import typing

        method = typing.get_type_hints(SpeculativeConfig)["method"]
    assert doc["method"] in _literals(method)


@pytest.mark.pairs("v0251", "v0250")
@pytest.mark.control("the README's serve line read by vLLM's own parser: no patch involved")
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
    assert args.kv_transfer_config.kv_load_failure_policy == "recompute"
    assert args.mamba_cache_mode == "align"
    assert args.speculative_config == {"method": "qwen3_5_mtp", "num_speculative_tokens": 3}

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


@pytest.mark.control("docs/install.md's commands keep check's refusal without the NPU runtime, before any patch is tried")
def test_readme_check_blocks_keep_checks_exit_code_on_this_pair(tmp_path):
    """Issue 36: step 3's blocks (docs/install.md), run as they stand with this pair's console script (no torch_npu
    here, so `check` refuses with 3): each exits 3 too, and the JSON one-liner prints the refusal
    instead of a KeyError. The runner is tests/unit/test_readme_blocks.py's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("readme_blocks", ROOT / "tests" / "unit" / "test_readme_blocks.py")
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    assert runner.check_exit_code() == 3
    step3 = [b for b in runner.all_blocks() if b.kind == "run" and "exit=check" in b.args]
    assert len(step3) == 2
    for block in step3:
        assert runner.problems(block, tmp_path) == [], block.code
    proc, _ = runner.execute(step3[1].code, (), tmp_path)
    assert proc.returncode == 3 and "NPU runtime is missing" in proc.stdout, proc.stdout + proc.stderr
