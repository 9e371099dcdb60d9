"""The releases the groups are declared for, each named once: vLLM's and vllm-ascend's PEP 440 ranges,
matched on the base release (``versions``: ``0.26.0rc1`` counts as ``0.26.0``). A group names one of
these in its declaration (``_checks.Group``); setup.cfg's ``vllm`` extra is :data:`SUPPORTED`'s vLLM
range (tests/unit/test_extras.py holds them together, and each pair of scripts/pairs.txt to them).

The supported pairs (scripts/pairs.txt, the README's version table): vLLM 0.25.x and 0.26 with
vllm-ascend 0.25.1rc1 / 0.26.0rc1 (the base releases), vllm-ascend 0.30.0rc2 on vLLM 0.29 and 0.30.
vLLM 0.27 / 0.28 and vllm-ascend 0.27-0.29 are never admitted (no pair was released for them).
"""

from __future__ import annotations

from typing import NamedTuple


class Ranges(NamedTuple):
    """What a group requires: vLLM's range and vllm-ascend's (the host's keys ``vllm`` / ``vllm_ascend``)."""

    vllm: str
    vllm_ascend: str


#: every supported pair: the base releases and vllm-ascend 0.30.0rc2 on vLLM 0.29 / 0.30
SUPPORTED = Ranges(">=0.25.0,<0.31,!=0.27.*,!=0.28.*", ">=0.25.1,<0.31,!=0.27.*,!=0.28.*,!=0.29.*")

#: the base releases: vLLM 0.25.x / 0.26 with vllm-ascend 0.25.1rc1 / 0.26.0rc1
V025_026 = Ranges(">=0.25.0,<0.27", ">=0.25.1,<0.27")

#: vLLM 0.25.x with vllm-ascend 0.25.1rc1 only (0.26.0rc1 fixed the defect, or fails fast on it)
V025 = Ranges(">=0.25.0,<0.26", ">=0.25.1,<0.26")

#: the base releases' vLLM with vllm-ascend 0.26.0rc1 only (0.25.1rc1 does not have the defect)
ASCEND_026 = Ranges(V025_026.vllm, ">=0.26.0,<0.27")

#: vllm-ascend 0.26.0rc1 and 0.30.0rc2, each on its own vLLM (0.25.1rc1 does not have the defect)
ASCEND_026_030 = Ranges(SUPPORTED.vllm, ">=0.26.0,<0.31,!=0.27.*,!=0.28.*,!=0.29.*")

#: vllm-ascend 0.30.0rc2 on vLLM 0.29 or 0.30
V029_030 = Ranges(">=0.29,<0.31", ">=0.30,<0.31")

#: vllm-ascend 0.30.0rc2 on vLLM 0.30 only (vLLM 0.29's scheduler unpacks one KV cache group: a
#: hybrid load-failure report raises there)
V030 = Ranges(">=0.30,<0.31", V029_030.vllm_ascend)

#: every range above, by name (tests/unit reads them all)
ALL = {name: value for name, value in dict(globals()).items() if isinstance(value, Ranges)}
