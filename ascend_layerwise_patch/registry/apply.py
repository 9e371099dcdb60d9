"""Applying one group (all of its specs or none) and keeping every copy of a target pointed at ours.

Mixed into :class:`~.activation.Registry`; it uses the registry's book-keeping (``_status``,
``_places``, ``_alias_paths``, ``_copy_states``, ``_late``, ``host``) and knows no patch.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

from . import install
from .spec import APPLIED, FAILED, FIXED_UPSTREAM, MARKER, PENDING, SKIPPED, PatchSpec, PatchStatus, split_path


class GroupApplier:
    # ------------------------------------------------------------------ one group
    def _apply_if_pending(self, group: str, specs: list[PatchSpec], just_imported: str | None = None) -> list[PatchStatus]:
        # _applying: a sibling module imported while this group resolves its targets re-enters here
        if group in self._applying or any(self._status[s.name].state != PENDING for s in specs):
            return []
        self._applying.add(group)
        try:
            return self._apply_group(group, specs, just_imported)
        finally:
            self._applying.discard(group)

    def _resolve_target(self, group: str, specs: list[PatchSpec], spec: PatchSpec, just_imported: str | None):
        """(parent, attribute, current) of ``spec``'s target, or the statuses to return instead."""
        if spec.module != just_imported and spec.module in sys.modules and install.module_ready(spec.module) is None:
            # A sibling target module is still executing (it imported the module whose hook
            # brought us here): stay pending; its own post-import hook retries the group.
            # (The module whose hook runs is itself still flagged as initializing.)
            return []
        try:
            if importlib.util.find_spec(spec.module) is None:  # imports the parent packages
                return self._fail(group, specs, spec, f"target moved: no module {spec.module}")
            module = importlib.import_module(spec.module)
        except ImportError as exc:
            # The module exists but cannot load with what is installed: nothing can run its
            # code, so nothing is at risk and there is nothing to patch.
            reason = f"{spec.module} does not import with the installed versions ({exc}); nothing to patch"
            for member in specs:
                self._set(member, SKIPPED, reason if member is spec else f"group {group}: {reason}")
            self.host.logger().info("ascend_layerwise_patch: group %s skipped: %s", group, reason)
            return []
        except Exception as exc:  # noqa: BLE001
            return self._fail(group, specs, spec, f"importing {spec.module} raised {exc!r}")
        try:
            return install.resolve(module, spec.qualname)
        except Exception as exc:  # noqa: BLE001 - any failure to reach the target is drift
            return self._fail(group, specs, spec, f"target not found: {exc}")

    def _apply_group(self, group: str, specs: list[PatchSpec], just_imported: str | None) -> list[PatchStatus]:
        plan: list[tuple[PatchSpec, Any, str, Any]] = []
        fixed: list[tuple[PatchSpec, str]] = []
        for spec in specs:
            found = self._resolve_target(group, specs, spec, just_imported)
            if isinstance(found, list):
                return found
            parent, attribute, current = found
            if getattr(current, MARKER, None) == spec.name:
                # Already ours (a second engine, or a re-import): adopt it, never wrap twice.
                self._places.adopt(spec.name, parent, attribute, current)
                self._set(spec, APPLIED, "already applied in this process")
                continue
            try:
                # Another group's patch may already sit on this attribute: we wrap it, but judge
                # the target by the patched package's own function under it.
                base = install.innermost(current)
                upstream = spec.fixed_upstream(base) if spec.fixed_upstream else None
                problem = spec.expects.problem(base) if spec.expects else None
                problem = problem or (spec.precondition(base) if spec.precondition else None)
                if problem and spec.risk:
                    problem = f"{problem}; {spec.risk}"
            except Exception as exc:  # noqa: BLE001
                return self._fail(group, specs, spec, f"precondition raised {exc!r}")
            if upstream:
                fixed.append((spec, upstream))
                continue
            if problem:
                return self._fail(group, specs, spec, f"target changed: {problem}")
            plan.append((spec, parent, attribute, current))
        if self._late and plan:
            copies = install.unknown_copies({id(current): spec for spec, _p, _a, current in plan}, self._alias_paths)
            if copies:
                spec, names = copies
                return self._fail(
                    group,
                    specs,
                    spec,
                    "activated after the target was imported, and copies of the original that this "
                    f"patch does not know of are held by {', '.join(names)}; activate earlier "
                    "(import ascend_layerwise_patch first, or use the vLLM plugin)",
                )

        done: list[PatchSpec] = []
        try:
            for spec, parent, attribute, current in plan:
                made = spec.factory(current, self.context) if spec.context else spec.factory(current)
                replacement = install.tag(made, spec.name, current)
                self._places.install(spec.name, parent, attribute, current, replacement)
                done.append(spec)
        except Exception as exc:  # noqa: BLE001 - roll back: nothing half-applied
            for spec in reversed(done):
                self._places.undo(spec.name, ())
            failing = plan[len(done)][0] if len(done) < len(plan) else specs[0]
            return self._fail(group, specs, failing, f"install failed: {exc!r}")

        for spec, _parent, _attribute, _current in plan:
            self._set(spec, APPLIED, "applied late (after the target was imported)" if self._late else "")
        for spec, why in fixed:
            self._set(spec, SKIPPED, f"{FIXED_UPSTREAM}: {why}")
        applied = [spec.name for spec, *_ in plan]
        if applied:
            self.host.logger().debug("ascend_layerwise_patch: applied %s", ", ".join(applied))
        return []

    def _fail(self, group: str, specs: list[PatchSpec], culprit: PatchSpec, reason: str) -> list[PatchStatus]:
        for spec in specs:
            self._set(spec, FAILED, reason if spec is culprit else f"group {group} left unpatched: {culprit.name} failed")
        self.host.logger().warning("ascend_layerwise_patch: group %s left unpatched: %s: %s", group, culprit.name, reason)
        return [self._status[s.name] for s in specs]

    # ------------------------------------------------------------------ copies
    def _find_aliases(self, group: str, specs: list[PatchSpec]) -> bool:
        """Add the copies each spec's ``find_aliases`` finds; a finder that raises fails the group."""
        for spec in specs:
            try:
                found = tuple(spec.find_aliases()) if spec.find_aliases else ()
            except Exception as exc:  # noqa: BLE001
                self._fail(group, specs, spec, f"finding the copies of {spec.target} raised {exc!r}")
                return False
            for alias in found:
                split_path(alias)
            self._alias_paths[spec.name] = tuple(dict.fromkeys((*spec.aliases, *found)))
        return True

    def _import_copies(self) -> None:
        """Import every module holding a copy of an applied patch, so each copy gets its state."""
        for spec in self.specs:
            for alias in self._alias_paths[spec.name] if self._places.holds(spec.name) else ():
                module = split_path(alias)[0]
                if module in sys.modules:
                    continue
                try:
                    importlib.import_module(module)
                except Exception as exc:  # noqa: BLE001 - nothing can run that copy here
                    self._copy_states[(spec.name, alias)] = (
                        SKIPPED,
                        f"{module} does not import with the installed versions ({exc}); nothing to patch",
                    )

    def _sync_aliases(self, just_imported: types.ModuleType | None = None) -> list[PatchStatus]:
        """Point every known copy of an original at our replacement (identity match only).

        A copy whose module is imported but that holds neither the original nor ours could not
        be patched: its whole group is taken back off and fails -- unless the spec names
        ``copied_by`` modules, whose import makes that copy (until then, or if they put something
        else there, the place is simply not a copy of this target). ``just_imported`` is the module
        whose post-import hook runs (finished, though still flagged as initializing).
        """
        failed: list[PatchStatus] = []
        for spec in self.specs:
            for alias in self._alias_paths[spec.name]:
                if not self._places.holds(spec.name):
                    break
                ours = self._places.ours(spec.name)
                module_name, qual = split_path(alias)
                module = install.module_ready(module_name)
                if just_imported is not None and module_name == just_imported.__name__:
                    module = just_imported
                if module is None:
                    continue
                try:
                    parent, attribute, current = install.resolve(module, qual)
                except Exception:  # noqa: BLE001 - the copy does not exist in this version
                    self._copy_states[(spec.name, alias)] = (SKIPPED, f"{module_name} has no {qual} in this version")
                    continue
                if current is self._places.original(spec.name):
                    try:
                        self._places.point_copy(spec.name, alias, parent, attribute)
                    except Exception as exc:  # noqa: BLE001
                        failed += self._take_back(spec, alias, f"copy {alias} could not be patched: {exc!r}")
                        continue
                    current = ours
                if current is ours:
                    self._copy_states[(spec.name, alias)] = (APPLIED, "")
                    if alias not in self._status[spec.name].aliases:
                        self._status[spec.name].aliases.append(alias)
                elif spec.copied_by:
                    waiting = [m for m in spec.copied_by if m not in sys.modules]
                    self._copy_states[(spec.name, alias)] = (
                        (PENDING, f"holds {install.describe(current)} until {', '.join(waiting)} copies the target here")
                        if waiting
                        else (SKIPPED, f"holds {install.describe(current)}, not a copy of the target; left as is")
                    )
                else:
                    failed += self._take_back(
                        spec, alias, f"copy {alias} holds {install.describe(current)}, neither the original nor this patch"
                    )
        return failed

    def _take_back(self, culprit: PatchSpec, alias: str, reason: str) -> list[PatchStatus]:
        """A copy could not be patched: undo the whole group (all-or-nothing) and fail it."""
        specs = self.groups()[culprit.group]
        for spec in specs:
            if not self._places.holds(spec.name):
                continue
            self._places.undo(spec.name, self._alias_paths[spec.name])
            self._status[spec.name].aliases = []
            for key in [key for key in self._copy_states if key[0] == spec.name]:
                del self._copy_states[key]
        self._copy_states[(culprit.name, alias)] = (FAILED, reason)
        return self._fail(culprit.group, specs, culprit, reason)
