"""What the registry needs to know of the process it patches: vLLM and vllm-ascend.

The registry (``registry/``) knows no package and no patch; :data:`HOST` tells it which versions are
installed (package metadata, never an import), where to log (vLLM's logger once vLLM's logging is
set up, so the lines read as vLLM's own), and which module sets that logging up.
"""

from __future__ import annotations

import os
import sys

from . import versions
from .registry.spec import Host

LOGGER_NAME = "vllm.ascend_layerwise_patch"
LOGGING_MODULE = "vllm.logger"


#: the words a patch's own switch reads as "off" (any case); "0" is not among them: its meaning is the switch's own
OFF_WORDS = frozenset({"off", "none", "false", "no"})


def switch(name: str, environ=None) -> str:
    """A patch's own switch ``name`` from ``environ`` (default: the process's), stripped and lower-case."""
    return (os.environ if environ is None else environ).get(name, "").strip().lower()


def logger():
    """vLLM's logger once vLLM's logging is set up in this process, else the standard one."""
    init = getattr(sys.modules.get(LOGGING_MODULE), "init_logger", None)
    if init is not None:
        return init(LOGGER_NAME)
    import logging

    return logging.getLogger(LOGGER_NAME)


def _logs_later(installed: dict) -> bool:
    """vLLM is installed but its logging is not set up yet: lines wait for it (one format)."""
    vllm = installed.get("vllm")
    return vllm is not None and vllm.raw is not None and LOGGING_MODULE not in sys.modules


HOST = Host(detect=lambda: versions.detect(), logger=logger, logging_module=LOGGING_MODULE, logs_later=_logs_later)
