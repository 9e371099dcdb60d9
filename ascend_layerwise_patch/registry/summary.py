"""The summary line: once per process when every patch's state has settled, again on a change.

Mixed into :class:`~.activation.Registry` (uses ``_status``, ``_versions``, ``_lock``, ``host``).
:func:`kind` and :func:`counts` are shared with ``check``'s terminal output.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable
from typing import Any

from . import install
from .spec import APPLIED, CONFLICT, FIXED_UPSTREAM, PENDING, REVERTED, SKIPPED, PatchSpec

#: what the summaries count, always shown in this order (``pending`` and ``reverted`` only when non-zero)
COUNTED = (APPLIED, "fixed upstream", SKIPPED, "failed")
#: the INFO line's message stays within this (vLLM's prefix, ``INFO 12-05 20:16:17 [summary.py:93] ``,
#: adds 36 characters: under 200 in all)
SUMMARY_MAX = 160


def kind(state: str, reason: str) -> str:
    """How a patch counts: applied, fixed upstream, skipped, failed (or conflict), pending, reverted."""
    if state == SKIPPED and reason.startswith(FIXED_UPSTREAM):
        return "fixed upstream"
    return "failed" if state == CONFLICT else state


def counts(kinds: Iterable[str]) -> str:
    """``"49 applied, 0 fixed upstream, 11 skipped, 0 failed"`` (+ pending / reverted when any)."""
    seen = Counter(kinds)
    return ", ".join(f"{seen[k]} {k}" for k in (*COUNTED, PENDING, REVERTED) if k in COUNTED or seen[k])


def _named(label: str, groups: list[str], room: int) -> str:
    """``"; failed: a, b"``, as many names as fit in ``room`` characters (then "and N more")."""
    for n in range(len(groups), 0, -1):
        text = f"; {label}: {', '.join(groups[:n])}" + (f" and {len(groups) - n} more" if n < len(groups) else "")
        if len(text) <= room:
            return text
    return f"; {label}: {len(groups)} group" + "s" * (len(groups) > 1)


class Summary:
    def _log_when_host_logs(self, level: str, msg: str, *args: Any) -> None:
        """Log through the host's logger: now if its logging is set up, else once it is."""
        if self._host_logs_later():
            install.wrapt().when_imported(self.host.logging_module)(lambda _module: getattr(self.host.logger(), level)(msg, *args))
        else:
            getattr(self.host.logger(), level)(msg, *args)

    def _host_logs_later(self) -> bool:
        return self.host.logging_module is not None and self.host.logs_later(self._versions)

    def _maybe_summarize(self, _module: Any = None) -> None:
        """The summary line, once the states settle (no patch pending), and again only when a
        state changes after that (a late failure, a conflict, a revert)."""
        with self._lock:
            if any(self._unsettled(spec) for spec in self.specs):
                return
            shown = tuple((st.name, st.state) for st in self._status.values())
            if shown == self._summarized:
                return
            if self._host_logs_later():
                if not self._summary_waits:
                    self._summary_waits = True
                    install.wrapt().when_imported(self.host.logging_module)(self._maybe_summarize)
                return
            self._summarized = shown
            self.log_summary()

    def _unsettled(self, spec: PatchSpec) -> bool:
        """Pending, and its target may still be imported in this process. A spec whose
        ``copied_by`` modules all ran without importing its target will not see it imported by
        the targets' own flow: that counts as settled."""
        if self._status[spec.name].state != PENDING:
            return False
        return not (spec.copied_by and spec.module not in sys.modules and all(m in sys.modules for m in spec.copied_by))

    def log_summary(self) -> None:
        """One INFO line per process, under 200 characters: versions, the counts, the groups failed
        or pending; every patch's state and reason at DEBUG (and in ``check --json``)."""
        with self._lock:
            statuses = list(self._status.values())
            vers = ", ".join(f"{k} {v}" for k, v in self._versions.items())
        kinds = [kind(st.state, st.reason) for st in statuses]
        line = f"ascend_layerwise_patch [{vers}]: {counts(kinds)}"
        for label in ("failed", PENDING):
            groups = list(dict.fromkeys(st.group for st, k in zip(statuses, kinds) if k == label))
            line += _named(label, groups, SUMMARY_MAX - len(line)) if groups else ""
        logger = self.host.logger()
        logger.info("%s", line)
        parts = [st.name if st.state == APPLIED else f"{st.name}={st.state}({st.reason})" for st in statuses]
        logger.debug("ascend_layerwise_patch [%s] every patch: %s", vers, "; ".join(parts))
