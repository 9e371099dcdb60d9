"""Real vLLM + vllm-ascend with the NPU runtime stood in; the library activated before vLLM loads."""

import logging
import sys

import pytest

from ascend_layerwise_patch import cpu_standins

cpu_standins.install()

import ascend_layerwise_patch  # noqa: E402,F401  (activates: post-import hooks only)

# vllm-ascend's layer threads are daemons that may still log ("Layerwise %d load waits for attention
# compute start") after pytest has closed the stream it captured for their test; the logging module
# would print a "--- Logging error --- ValueError: I/O operation on closed file" traceback for each.
logging.raiseExceptions = False


class LogRecords(logging.Handler):
    """Every record logged through vLLM's logger (vllm-ascend's and this library's are children)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def warnings_naming(self, text: str) -> list[logging.LogRecord]:
        return [r for r in list(self.records) if r.levelno >= logging.WARNING and text in r.getMessage()]


@pytest.fixture
def vllm_log():
    handler = LogRecords()
    log = logging.getLogger("vllm")
    log.addHandler(handler)
    yield handler
    log.removeHandler(handler)


@pytest.fixture
def patched():
    """The library re-activated as configured for the test (whatever an earlier test of this process
    left), and again after it."""
    reg = ascend_layerwise_patch.REGISTRY
    reg.revert()
    reg.activate()
    yield reg
    reg.activate()


@pytest.fixture(autouse=True)
def _rank_processes_closed():
    """After each test: the rank processes of every pool instance it left open are closed (a test
    that failed before closing its instances would leave them running)."""
    yield
    rank_procs = sys.modules.get("rank_procs")
    if rank_procs is not None:
        rank_procs.close_all()


def _states(reg) -> dict[str, str]:
    return {st.name: st.state for st in reg.status()}


@pytest.fixture(autouse=True)
def _library_left_as_configured(request):
    """After each test: the library is as this process's environment configures it. A test that
    re-activated it otherwise (a group skipped, the library off) and did not restore it fails here,
    and the next test still starts as configured: no module runs on a state another one left."""
    reg = ascend_layerwise_patch.REGISTRY
    before = _states(reg)
    yield
    after = _states(reg)
    if after == before:
        return
    from support import activate_skipping

    configured = _states(activate_skipping())
    left = {name: state for name, state in after.items() if configured.get(name) != state}
    if left:
        pytest.fail(f"the test left the library re-activated otherwise than configured (restored now): {sorted(left.items())[:6]}")
