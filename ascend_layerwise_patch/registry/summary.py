"""The summary line: once per process when every patch's state has settled, again on a change.

Mixed into :class:`~.activation.Registry` (uses ``_status``, ``_versions``, ``_lock``, ``host``).
"""

from __future__ import annotations

import sys
from typing import Any

from . import install
from .spec import APPLIED, PENDING, PatchSpec


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
        """One line per process: versions, then every patch's state (with reasons if not applied)."""
        with self._lock:
            parts = [st.name if st.state == APPLIED else f"{st.name}={st.state}({st.reason})" for st in self._status.values()]
            vers = ", ".join(f"{k} {v}" for k, v in self._versions.items())
        self.host.logger().info("ascend_layerwise_patch [%s]: %s", vers, "; ".join(parts))
