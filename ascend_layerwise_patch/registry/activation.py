"""The registry: which groups are in force, hooking their modules, status, revert, the summary line.

Life of a group in one process::

    activate()  -- versions out of range, switched off, skipped -> SKIPPED (never hooked)
                -- otherwise hook every target module             -> PENDING
    first target module imported (or already imported)
                -- resolve every target of the group (importing the sibling modules),
                   check fixed-upstream detectors and preconditions, then install all
                   replacements, or none                          -> APPLIED / FAILED
    any hooked module imported later
                -- re-point every known alias (``from x import f`` copies, class attributes
                   copied by the patched package's own late patches) that still holds an original
    revert()    -- put back exactly what was there                 -> REVERTED / CONFLICT
"""

from __future__ import annotations

import threading
import types
from collections.abc import Iterable, Mapping
from typing import Any

from ..versions import in_range
from . import install
from .apply import GroupApplier
from .summary import Summary
from .spec import (
    APPLIED,
    CONFLICT,
    PLAIN,
    PORTED,
    Context,
    Host,
    PENDING,
    REVERTED,
    SKIPPED,
    PatchError,
    PatchSpec,
    PatchStatus,
    check_order,
    raise_failures,
    split_path,
)
from .switches import ENV_ENABLE, ENV_SKIP, Switches


class Registry(GroupApplier, Summary):
    """Applies a fixed list of :class:`PatchSpec` s. Thread-safe; idempotent by identity."""

    def __init__(self, specs: Iterable[PatchSpec], *, host: Host = PLAIN):
        self.host = host
        self.specs: tuple[PatchSpec, ...] = tuple(specs)
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate patch names in {names}")
        for spec in self.specs:
            for path in (spec.target, *spec.aliases):
                split_path(path)
        check_order(self.specs)
        self._lock = threading.RLock()
        self._active = False
        self._late = False
        self._switches = Switches.read({})
        self._hooked: set[str] = set()
        self._applying: set[str] = set()
        self._versions: dict[str, Any] = {}
        self._unneeded: dict[str, str] = {}  # member out of its own version range -> why (the rest applies)
        self._status: dict[str, PatchStatus] = {
            s.name: PatchStatus(
                s.name, s.group, s.target, PENDING, "not activated yet (activation runs when the patched packages are imported)", ranges=dict(s.requires)
            )
            for s in self.specs
        }
        self._places = install.Places()
        #: every alias path of each spec: the declared ones, then those ``find_aliases`` found
        self._alias_paths: dict[str, tuple[str, ...]] = {s.name: tuple(s.aliases) for s in self.specs}
        #: (spec name, alias path) -> (state, reason) of that copy
        self._copy_states: dict[tuple[str, str], tuple[str, str]] = {}
        #: configuration mistakes found at activation (e.g. an unknown name in ASCEND_LAYERWISE_PATCH_SKIP)
        self.config_errors: list[str] = []
        #: what factories of ``PatchSpec.context`` specs read: the live states of a group
        self.context = Context(lambda group: frozenset(st.state for st in self._status.values() if st.group == group))
        self._summarized: tuple | None = None  # the states the last summary line showed
        self._summary_waits = False

    # ------------------------------------------------------------------ public API
    def groups(self) -> dict[str, list[PatchSpec]]:
        """Every group with the members in force on the installed versions (a member whose own
        range leaves the installed versions out is not part of its group there)."""
        out: dict[str, list[PatchSpec]] = {}
        for spec in self.specs:
            if spec.name not in self._unneeded:
                out.setdefault(spec.group, []).append(spec)
        return out

    def status(self) -> list[PatchStatus]:
        with self._lock:
            out = []
            for st in self._status.values():
                copy = PatchStatus(**st.as_dict())
                copy.places = self._places_of(st)
                out.append(copy)
        for spec, st in zip(self.specs, out):
            if spec.counters is not None and st.state == APPLIED:
                st.counters = dict(spec.counters())
        return out

    @property
    def active(self) -> bool:
        return self._active

    def activate(self, environ: Mapping[str, str] | None = None) -> list[PatchStatus]:
        """Hook every in-range group; apply at once those whose modules are already imported.

        A second call while active changes nothing. In strict mode
        (``ASCEND_LAYERWISE_PATCH_STRICT=1``) every call raises :class:`PatchError` while an
        in-range group has failed -- so vLLM's plugin call aborts start-up, as asked.
        """
        with self._lock:
            if self._active:
                self._raise_if_strict(self._status.values())
                return self.status()
            self._active = True
            self._switches = Switches.read(environ)
            self._versions = dict(self.host.detect())
            shown = {key: inst.raw for key, inst in self._versions.items()}
            for st in self._status.values():
                st.versions = dict(shown)
                st.aliases = []

            if self._switches.disabled is not None:
                for st in self._status.values():
                    st.state, st.reason = SKIPPED, f"disabled by {ENV_ENABLE}={self._switches.disabled}"
                self._maybe_summarize()
                return self.status()

            self._find_unneeded()
            for name, why in self._unneeded.items():
                self._status[name].state, self._status[name].reason = SKIPPED, why
            self.config_errors = self._switches.errors([s.name for s in self.specs], self.groups())
            for error in self.config_errors:
                self._log_when_host_logs("error", "ascend_layerwise_patch: %s", error)
            live: list[str] = []
            for group, specs in self.groups().items():
                reason = self._skip_reason(group, specs)
                if reason is not None:
                    for spec in specs:
                        self._set(spec, SKIPPED, reason)
                    continue
                for spec in specs:
                    self._set(spec, PENDING, f"waiting for {spec.module} to be imported")
                if self._find_aliases(group, specs):
                    live.append(group)

            self._late = True  # targets found already imported were imported before activation
            try:
                for group in live:
                    for spec in self.groups()[group]:
                        self._hook(spec.module)
                        for module in (*(split_path(a)[0] for a in self._alias_paths[spec.name]), *spec.copied_by):
                            self._hook(module)
            finally:
                self._late = False
            self._maybe_summarize()
            self._raise_if_strict(self._status.values())
        return self.status()

    def switch_errors(self, environ: Mapping[str, str] | None = None) -> list[str]:
        """Mistakes in the switches of ``environ`` (the process's environment by default)."""
        return Switches.read(environ).errors([s.name for s in self.specs], self.groups())

    def apply_pending(self) -> list[PatchStatus]:
        """Import the targets of every pending group now and apply them (used by ``check``)."""
        failed: list[PatchStatus] = []
        with self._lock:
            if self._active:
                for group, specs in self.groups().items():
                    failed += self._apply_if_pending(group, specs)
                self._import_copies()
                failed += self._sync_aliases()
                self._maybe_summarize()
        if self._switches.strict:
            raise_failures(failed)
        return self.status()

    def revert(self) -> list[PatchStatus]:
        """Undo every applied patch exactly; report (and leave) any that someone replaced since."""
        with self._lock:
            by_name = {spec.name: spec for spec in self.specs}
            # newest first: a patch stacked on another group's patch of the same attribute comes off first
            for name in self._places.newest_first():
                spec = by_name[name]
                replaced_by = self._places.undo(name, self._alias_paths[name])
                if replaced_by is not None:
                    why = f"{spec.target} was replaced by {install.describe(replaced_by)} after we patched it; left as is"
                    self._set(spec, CONFLICT, why)
                else:
                    self._set(spec, REVERTED, "reverted")
            for st in self._status.values():
                if st.state in (PENDING, SKIPPED):
                    st.state, st.reason = REVERTED, "registry reverted before this patch applied"
            self._copy_states.clear()
            self._active = False
            self._maybe_summarize()
            return self.status()

    # ------------------------------------------------------------------ decisions
    def _misses(self, requires) -> str | None:
        """Why the host's versions are outside ``requires`` (None: inside)."""
        for key, wanted in requires.items():
            if wanted is not None:
                if key not in self._versions:
                    return f"needs {key} {wanted}, which the host does not detect"
                ok, why = in_range(self._versions[key], wanted)
                if not ok:
                    return why
        return None

    def _out_of_range(self, spec: PatchSpec) -> str | None:
        why = self._misses(spec.requires)
        if why is None:
            return None
        for requires, where in spec.ported_to:
            if self._misses(requires) is None:
                return f"{PORTED}: on these versions {where} carries this fix (version out of range: {why})"
        return f"version out of range: {why}"

    def _find_unneeded(self) -> None:
        """Members out of their own range in a group that has members in range: left out, and the
        group applies without them (a group all of whose members are out of range is skipped)."""
        self._unneeded = {}
        by_group: dict[str, list[PatchSpec]] = {}
        for spec in self.specs:
            by_group.setdefault(spec.group, []).append(spec)
        for group, specs in by_group.items():
            reasons = {spec.name: self._out_of_range(spec) for spec in specs}
            if any(r is None for r in reasons.values()):
                for name, why in reasons.items():
                    if why is not None:
                        self._unneeded[name] = f"{why} (not needed there; the rest of group {group} applies without it)"

    def _skip_reason(self, group: str, specs: list[PatchSpec]) -> str | None:
        skip = self._switches.skip
        if group in skip:
            return f"skipped by {ENV_SKIP}"
        for spec in specs:
            if spec.name in skip:
                return f"skipped by {ENV_SKIP}" if len(specs) == 1 else f"group {group}: {spec.name} skipped by {ENV_SKIP}"
        for spec in specs:
            why = self._out_of_range(spec)
            if why is not None:
                return why
        return None

    def _raise_if_strict(self, statuses: Iterable[PatchStatus]) -> None:
        if self._switches.strict:
            if self.config_errors:
                raise PatchError("; ".join(self.config_errors))
            raise_failures(statuses)

    # ------------------------------------------------------------------ hooks
    def _hook(self, module: str) -> None:
        if module in self._hooked:
            ready = install.module_ready(module)
            if ready is not None:
                self._on_import(ready)
            return
        self._hooked.add(module)
        install.wrapt().register_post_import_hook(self._on_import, module)

    def _on_import(self, module: types.ModuleType) -> None:
        failed: list[PatchStatus] = []
        with self._lock:
            if not self._active:
                return
            name = module.__name__
            for group, specs in self.groups().items():
                if any(spec.module == name for spec in specs):
                    failed += self._apply_if_pending(group, specs, name)
            failed += self._sync_aliases(module)
            self._maybe_summarize()
        if self._switches.strict:
            raise_failures(failed)

    # ------------------------------------------------------------------ state and log
    def _set(self, spec: PatchSpec, state: str, reason: str) -> None:
        st = self._status[spec.name]
        st.state, st.reason = state, reason

    def _places_of(self, st: PatchStatus) -> list[dict[str, str]]:
        """The target, then every copy, each with its own state (a copy follows its patch until
        the patch is applied; then it is ``pending`` until its module is imported)."""
        places = [{"place": st.target, "role": "target", "state": st.state, "reason": st.reason}]
        for alias in self._alias_paths[st.name]:
            default = (PENDING, f"{split_path(alias)[0]} not imported in this process") if st.state == APPLIED else (st.state, "")
            state, reason = self._copy_states.get((st.name, alias), default)
            places.append({"place": alias, "role": "copy", "state": state, "reason": reason})
        return places
