"""Group ``load_failures_policy``: vllm-ascend's platform refusal of
``kv_load_failure_policy=recompute`` for hybrid models is lifted while ``load_failures`` is in force."""

from __future__ import annotations

import functools

from .._checks import source as _source
from ._common import GROUP, POLICY_GROUP


def make_policy_check(original, context):
    """vllm-ascend's platform refuses ``kv_load_failure_policy=recompute`` for hybrid models (the
    scheduler could not roll them back); with ``load_failures`` in force it can: applied in this
    process, or waiting for its modules (not skipped, not failed), read from the registry's
    ``context``. The platform's config check runs long before the scheduler and pool modules are
    imported, which is why the refusal is lifted by its own group, coupled through this. Installed
    as a plain function: vllm-ascend calls it through the class (``cls._validate_...``)."""
    check = original.__func__

    @functools.wraps(check)
    def _validate_kv_load_failure_policy(vllm_config):
        kv = vllm_config.kv_transfer_config
        if kv is not None and getattr(kv, "kv_load_failure_policy", "fail") == "recompute":
            if getattr(vllm_config.model_config, "is_hybrid", False) and context.in_force(GROUP):
                return None  # load_failures rolls hybrid requests back
        return check(vllm_config)

    return _validate_kv_load_failure_policy


def _policy_ok(original) -> str | None:
    func = getattr(original, "__func__", None)
    if not isinstance(original, staticmethod) or func is None:
        return "NPUPlatform._validate_kv_load_failure_policy is no longer a staticmethod"
    import inspect

    if list(inspect.signature(func).parameters) != ["vllm_config"]:
        return "NPUPlatform._validate_kv_load_failure_policy parameters changed"
    platform = func.__globals__.get("NPUPlatform")
    if platform is None or "cls._validate_kv_load_failure_policy(" not in _source(platform.check_and_update_config):
        return "NPUPlatform.check_and_update_config no longer calls it through the class"
    return None


def _upstream_allows_hybrid(original) -> str | None:
    func = getattr(original, "__func__", original)
    if "is_hybrid" not in _source(func):
        return "vllm-ascend no longer refuses recompute for hybrid models"
    return None


SPECS = (
    POLICY_GROUP.spec(
        "load_fail_policy",
        "vllm_ascend.platform:NPUPlatform._validate_kv_load_failure_policy",
        make_policy_check,
        precondition=_policy_ok,
        fixed_upstream=_upstream_allows_hybrid,
        context=True,
    ),
)
