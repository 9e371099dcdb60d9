"""Group ``pool_load_recovery_policy``: vllm-ascend 0.30's platform refusal of
``kv_load_failure_policy=recompute`` for hybrid models is lifted while ``pool_load_recovery`` is in
force (applied, or waiting for its modules); otherwise the refusal stands."""

from __future__ import annotations

import functools

from .._checks import param_names as _params
from .._checks import source as _source
from ._common import GROUP, POLICY_GROUP


def make_policy_check(original, context):
    """The platform's module-level config check (called by name from ``_check_ascend_config``):
    ``recompute`` for a hybrid model passes while ``pool_load_recovery`` is in force, read from the
    registry's context at each call; everything else is the original check."""

    @functools.wraps(original)
    def _validate_kv_load_failure_policy(vllm_config):
        kv = vllm_config.kv_transfer_config
        recompute = kv is not None and getattr(kv, "kv_load_failure_policy", "fail") == "recompute"
        if recompute and getattr(vllm_config.model_config, "is_hybrid", False) and context.in_force(GROUP):
            return None  # pool_load_recovery rolls hybrid requests back by preemption
        return original(vllm_config)

    return _validate_kv_load_failure_policy


def _policy_ok(original) -> str | None:
    if not callable(original) or _params(original) != ["vllm_config"]:
        return "vllm_ascend.platform._validate_kv_load_failure_policy is not a function of vllm_config"
    caller = original.__globals__.get("_check_ascend_config")
    if caller is None or "_validate_kv_load_failure_policy(vllm_config)" not in _source(caller):
        return "vllm_ascend.platform._check_ascend_config no longer calls it by its module-level name"
    return None


def _upstream_allows_hybrid(original) -> str | None:
    if "is_hybrid" not in _source(original):
        return "vllm-ascend no longer refuses recompute for hybrid models"
    return None


SPECS = (
    POLICY_GROUP.spec(
        "pool_load_policy",
        "vllm_ascend.platform:_validate_kv_load_failure_policy",
        make_policy_check,
        precondition=_policy_ok,
        fixed_upstream=_upstream_allows_hybrid,
        context=True,
        why="vllm-ascend 0.30 accepts kv_load_failure_policy=recompute for hybrid models while pool_load_recovery "
        "rolls them back",
        risk="recompute (a failed load costs time, not the request) cannot be configured for hybrid models",
    ),
)
