"""The patch engine: declarative patch specs, applied through wrapt's post-import hooks.

The engine knows nothing of any particular patch. A patch is a :class:`PatchSpec` (data plus
three callables); specs that share a ``group`` apply together or not at all.

Life of a group in one process::

    activate()  -- versions out of range, switched off, skipped -> SKIPPED (never hooked)
                -- otherwise hook every target module             -> PENDING
    first target module imported (or already imported)
                -- resolve every target of the group (importing the sibling modules),
                   check fixed-upstream detectors and preconditions, then install all
                   replacements, or none                          -> APPLIED / FAILED
    any hooked module imported later
                -- re-point every known alias (``from x import f`` copies, class attributes
                   copied by vllm-ascend's own late patches) that still holds an original
    revert()    -- put back exactly what was there                 -> REVERTED / CONFLICT

Replacements are installed with plain ``setattr`` on the raw attribute that wrapt's
``resolve_path`` finds (the MRO's ``vars()``, not a bound method). They are whatever the spec's
factory returns -- for hot paths a plain function, since a wrapt ``FunctionWrapper`` costs ~0.45 us
per call and Dynamo refuses it inside compiled forwards. Every replacement is tagged with
``__ascend_layerwise_patch__`` (the spec name) and ``__wrapped__`` (the original), so a second
activation -- even from a second engine -- recognises it by identity and never wraps twice.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import threading
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from . import versions as _versions

MARKER = "__ascend_layerwise_patch__"
LOGGER_NAME = "vllm.ascend_layerwise_patch"

APPLIED = "applied"
PENDING = "pending"
SKIPPED = "skipped"
FAILED = "failed"
CONFLICT = "conflict"
REVERTED = "reverted"

ENV_ENABLE = "ASCEND_LAYERWISE_PATCH"
ENV_SKIP = "ASCEND_LAYERWISE_PATCH_SKIP"
ENV_STRICT = "ASCEND_LAYERWISE_PATCH_STRICT"

Check = Callable[[Any], "str | None"]


class PatchError(RuntimeError):
    """Raised in strict mode when a patch that is in range cannot be applied."""


class PatchSpec(NamedTuple):
    """One patch, declared as data.

    ``target`` and each alias are ``"package.module:Qualified.name"``. ``factory(original)``
    returns what is installed in place of ``original``. ``precondition(original)`` and
    ``fixed_upstream(original)`` return ``None`` when all is well, else the reason (a target that
    drifted fails the whole group; a target that already carries the fix is skipped).
    Version ranges are PEP 440 specifiers matched on the base release (see ``versions``);
    ``None`` for a range means the patch does not depend on that package. ``copied_by`` names
    modules whose import copies the target into an alias (vllm-ascend's late worker patches):
    their import re-points the aliases, whatever the order. ``find_aliases()``, called once at
    activation, returns more alias paths found in what is installed (see :func:`copies_in_source`).
    Patches of different groups may target the same attribute: the later one wraps the earlier
    one's replacement, its checks see the original under both, and ``revert()`` takes them off
    newest first. ``counters()``, if given, returns the patch's live counts in this process (shown in
    ``status()`` while it is applied).
    """

    name: str
    group: str
    target: str
    factory: Callable[[Any], Any]
    why: str
    vllm: str | None
    vllm_ascend: str | None = None
    aliases: tuple[str, ...] = ()
    copied_by: tuple[str, ...] = ()
    precondition: Check | None = None
    fixed_upstream: Check | None = None
    find_aliases: Callable[[], Iterable[str]] | None = None
    counters: Callable[[], Mapping[str, int]] | None = None

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def qualname(self) -> str:
        return self.target.partition(":")[2]


class PatchStatus:
    """One patch's state in this process (``state`` is one of the constants above)."""

    __slots__ = ("name", "group", "target", "state", "reason", "versions", "ranges", "aliases", "places", "counters")

    def __init__(
        self, name, group, target, state, reason="", versions=None, ranges=None, aliases=None, places=None, counters=None
    ):
        self.name, self.group, self.target, self.state, self.reason = name, group, target, state, reason
        self.versions: dict[str, str | None] = dict(versions or {})
        self.ranges: dict[str, str | None] = dict(ranges or {})
        #: the copies (``from x import f``) that now hold our replacement
        self.aliases: list[str] = list(aliases or [])
        #: every place this patch installs itself -- the target, then each copy -- with its own state
        self.places: list[dict[str, str]] = [dict(p) for p in places or []]
        #: live counts of an applied patch (``PatchSpec.counters``)
        self.counters: dict[str, int] = dict(counters or {})

    def as_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self.__slots__}

    def __repr__(self) -> str:
        return f"PatchStatus({self.name!r}, {self.state!r}, {self.reason!r})"


class _Installed(NamedTuple):
    """Book-keeping for one place we replaced: enough to undo it exactly."""

    parent: Any
    attribute: str
    original: Any
    defined_here: bool


def _wrapt():
    """wrapt, imported on first use: it pulls in asyncio and importlib.metadata (~35 ms in a
    fresh interpreter), which vLLM imports anyway but a bare ``import ascend_layerwise_patch``
    should not pay for."""
    import wrapt

    return wrapt


def _split(path: str) -> tuple[str, str]:
    module, _, qual = path.partition(":")
    if not module or not qual:
        raise ValueError(f"patch path {path!r} must look like 'package.module:Qualified.name'")
    return module, qual


def _defined_here(parent: Any, attribute: str) -> bool:
    if isinstance(parent, type):
        return attribute in vars(parent)
    return hasattr(parent, attribute)


def _module_ready(name: str) -> types.ModuleType | None:
    """The module if it is imported and finished executing, else ``None``."""
    module = sys.modules.get(name)
    if module is None:
        return None
    spec = getattr(module, "__spec__", None)
    if spec is not None and getattr(spec, "_initializing", False):
        return None
    return module


def _env_list(value: str | None) -> set[str]:
    return {part.strip() for part in (value or "").split(",") if part.strip()}


def _is_true(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def _is_false(value: str | None) -> bool:
    return (value or "").strip().lower() in {"0", "false", "no", "off"}


def logger():
    """vLLM's logger once vLLM's logging is set up in this process, else the standard one."""
    vllm_logger = sys.modules.get("vllm.logger")
    init = getattr(vllm_logger, "init_logger", None)
    if init is not None:
        return init(LOGGER_NAME)
    import logging

    return logging.getLogger(LOGGER_NAME)


class Registry:
    """Applies a fixed list of :class:`PatchSpec` s. Thread-safe; idempotent by identity."""

    def __init__(self, specs: Iterable[PatchSpec]):
        self.specs: tuple[PatchSpec, ...] = tuple(specs)
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate patch names in {names}")
        for spec in self.specs:
            _split(spec.target)
            for alias in spec.aliases:
                _split(alias)
        self._lock = threading.RLock()
        self._active = False
        self._late = False
        self._strict = False
        self._hooked: set[str] = set()
        self._applying: set[str] = set()
        self._versions: dict[str, _versions.Installed] = {}
        self._unneeded: dict[str, str] = {}  # member out of its own version range -> why (the rest applies)
        self._status: dict[str, PatchStatus] = {
            s.name: PatchStatus(
                s.name, s.group, s.target, PENDING, "not activated yet (activation runs when vLLM is imported)", ranges={"vllm": s.vllm, "vllm_ascend": s.vllm_ascend}
            )
            for s in self.specs
        }
        self._installed: dict[str, _Installed] = {}
        self._replacement: dict[str, Any] = {}
        self._aliases: dict[tuple[str, str], _Installed] = {}
        #: every alias path of each spec: the declared ones, then those ``find_aliases`` found
        self._alias_paths: dict[str, tuple[str, ...]] = {s.name: tuple(s.aliases) for s in self.specs}
        #: (spec name, alias path) -> (state, reason) of that copy
        self._places: dict[tuple[str, str], tuple[str, str]] = {}
        #: configuration mistakes found at activation (e.g. an unknown name in ASCEND_LAYERWISE_PATCH_SKIP)
        self.config_errors: list[str] = []
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

    def _out_of_range(self, spec: PatchSpec) -> str | None:
        for key, wanted in (("vllm", spec.vllm), ("vllm_ascend", spec.vllm_ascend)):
            if wanted is not None:
                ok, why = _versions.in_range(self._versions[key], wanted)
                if not ok:
                    return f"version out of range: {why}"
        return None

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

    def _places_of(self, st: PatchStatus) -> list[dict[str, str]]:
        """The target, then every copy, each with its own state (a copy follows its patch until
        the patch is applied; then it is ``pending`` until its module is imported)."""
        places = [{"place": st.target, "role": "target", "state": st.state, "reason": st.reason}]
        for alias in self._alias_paths[st.name]:
            default = (PENDING, f"{_split(alias)[0]} not imported in this process") if st.state == APPLIED else (st.state, "")
            state, reason = self._places.get((st.name, alias), default)
            places.append({"place": alias, "role": "copy", "state": state, "reason": reason})
        return places

    @property
    def active(self) -> bool:
        return self._active

    def activate(self, environ: Mapping[str, str] | None = None) -> list[PatchStatus]:
        """Hook every in-range group; apply at once those whose modules are already imported.

        A second call while active changes nothing. In strict mode
        (``ASCEND_LAYERWISE_PATCH_STRICT=1``) every call raises :class:`PatchError` while an
        in-range group has failed -- so vLLM's plugin call aborts start-up, as asked.
        """
        env = os.environ if environ is None else environ
        with self._lock:
            if self._active:
                self._raise_if_strict(self._status.values(), env)
                return self.status()
            self._active = True
            self._strict = _is_true(env.get(ENV_STRICT))
            self._versions = _versions.detect()
            shown = {key: inst.raw for key, inst in self._versions.items()}
            for st in self._status.values():
                st.versions = dict(shown)
                st.aliases = []

            if _is_false(env.get(ENV_ENABLE)):
                for st in self._status.values():
                    st.state, st.reason = SKIPPED, f"disabled by {ENV_ENABLE}={env.get(ENV_ENABLE)}"
                self._maybe_summarize()
                return self.status()

            skip = _env_list(env.get(ENV_SKIP))
            self._find_unneeded()
            for name, why in self._unneeded.items():
                st = self._status[name]
                st.state, st.reason = SKIPPED, why
            self.config_errors = self.switch_errors(env)
            for error in self.config_errors:
                self._log_when_vllm_logs("error", "ascend_layerwise_patch: %s", error)
            live: list[str] = []
            for group, specs in self.groups().items():
                reason = self._skip_reason(group, specs, skip)
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
                        for module in (*(_split(a)[0] for a in self._alias_paths[spec.name]), *spec.copied_by):
                            self._hook(module)
            finally:
                self._late = False
            self._maybe_summarize()
            self._raise_if_strict(self._status.values(), env)
        return self.status()

    def switch_errors(self, environ: Mapping[str, str] | None = None) -> list[str]:
        """Mistakes in the switches: a name in ``ASCEND_LAYERWISE_PATCH_SKIP`` that is no patch
        and no group (a typo would otherwise leave on the patch it meant)."""
        env = os.environ if environ is None else environ
        unknown = _env_list(env.get(ENV_SKIP)) - {s.name for s in self.specs} - {s.group for s in self.specs}
        if not unknown:
            return []
        return [
            f"{ENV_SKIP} names no patch or group: {', '.join(sorted(unknown))} "
            f"(valid patches: {', '.join(s.name for s in self.specs)}; valid groups: {', '.join(self.groups())})"
        ]

    def _find_aliases(self, group: str, specs: list[PatchSpec]) -> bool:
        """Add the copies each spec's ``find_aliases`` finds; a finder that raises fails the group."""
        for spec in specs:
            try:
                found = tuple(spec.find_aliases()) if spec.find_aliases else ()
            except Exception as exc:  # noqa: BLE001
                self._fail(group, specs, spec, f"finding the copies of {spec.target} raised {exc!r}")
                return False
            for alias in found:
                _split(alias)
            self._alias_paths[spec.name] = tuple(dict.fromkeys((*spec.aliases, *found)))
        return True

    def _raise_if_strict(self, statuses: Iterable[PatchStatus], env: Mapping[str, str]) -> None:
        if _is_true(env.get(ENV_STRICT)):
            if self.config_errors:
                raise PatchError("; ".join(self.config_errors))
            _raise_failures(statuses)

    def apply_pending(self) -> list[PatchStatus]:
        """Import the targets of every pending group now and apply them (used by ``check``)."""
        failed: list[PatchStatus] = []
        with self._lock:
            if self._active:
                for group, specs in self.groups().items():
                    failed += self._apply_if_pending(group, specs)
                failed += self._import_copies()
                failed += self._sync_aliases()
                self._maybe_summarize()
        if self._strict:
            _raise_failures(failed)
        return self.status()

    def _import_copies(self) -> list[PatchStatus]:
        """Import every module holding a copy of an applied patch, so each copy gets its state."""
        failed: list[PatchStatus] = []
        for spec in self.specs:
            for alias in self._alias_paths[spec.name] if spec.name in self._replacement else ():
                module = _split(alias)[0]
                if module in sys.modules:
                    continue
                try:
                    importlib.import_module(module)
                except Exception as exc:  # noqa: BLE001 - nothing can run that copy here
                    self._places[(spec.name, alias)] = (
                        SKIPPED,
                        f"{module} does not import with the installed versions ({exc}); nothing to patch",
                    )
        return failed

    def revert(self) -> list[PatchStatus]:
        """Undo every applied patch exactly; report (and leave) any that someone replaced since."""
        with self._lock:
            by_name = {spec.name: spec for spec in self.specs}
            # newest first: a patch stacked on another group's patch of the same attribute comes off first
            for spec in [by_name[name] for name in reversed(list(self._installed))]:
                inst = self._installed[spec.name]
                ours = self._replacement[spec.name]
                current = self._raw(inst.parent, inst.attribute)
                for (name, alias), place in list(self._aliases.items()):
                    if name != spec.name:
                        continue
                    if self._raw(place.parent, place.attribute) is ours:
                        self._restore(place)
                    del self._aliases[(name, alias)]
                self._restore_aliases_copied_by_others(spec, ours, inst.original)
                del self._installed[spec.name]
                del self._replacement[spec.name]
                if current is not ours:
                    self._set(
                        spec,
                        CONFLICT,
                        f"{spec.target} was replaced by {_describe(current)} after we patched it; left as is",
                    )
                    continue
                self._restore(inst)
                self._set(spec, REVERTED, "reverted")
            for st in self._status.values():
                if st.state in (PENDING, SKIPPED):
                    st.state, st.reason = REVERTED, "registry reverted before this patch applied"
            self._places.clear()
            self._active = False
            self._maybe_summarize()
            return self.status()

    # ------------------------------------------------------------------ decisions
    def _skip_reason(self, group: str, specs: list[PatchSpec], skip: set[str]) -> str | None:
        if group in skip:
            return f"skipped by {ENV_SKIP}"
        for spec in specs:
            if spec.name in skip:
                return (
                    f"skipped by {ENV_SKIP}" if len(specs) == 1 else f"group {group}: {spec.name} skipped by {ENV_SKIP}"
                )
        for spec in specs:
            why = self._out_of_range(spec)
            if why is not None:
                return why
        return None

    def _hook(self, module: str) -> None:
        if module in self._hooked:
            ready = _module_ready(module)
            if ready is not None:
                self._on_import(ready)
            return
        self._hooked.add(module)
        _wrapt().register_post_import_hook(self._on_import, module)

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
        if self._strict:
            _raise_failures(failed)

    def _apply_if_pending(self, group: str, specs: list[PatchSpec], just_imported: str | None = None) -> list[PatchStatus]:
        # _applying: a sibling module imported while this group resolves its targets re-enters here
        if group in self._applying or any(self._status[s.name].state != PENDING for s in specs):
            return []
        self._applying.add(group)
        try:
            return self._apply_group(group, specs, just_imported)
        finally:
            self._applying.discard(group)

    def _apply_group(self, group: str, specs: list[PatchSpec], just_imported: str | None) -> list[PatchStatus]:
        plan: list[tuple[PatchSpec, Any, str, Any]] = []
        fixed: list[tuple[PatchSpec, str]] = []
        for spec in specs:
            if spec.module != just_imported and spec.module in sys.modules and _module_ready(spec.module) is None:
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
                logger().info("ascend_layerwise_patch: group %s skipped: %s", group, reason)
                return []
            except Exception as exc:  # noqa: BLE001
                return self._fail(group, specs, spec, f"importing {spec.module} raised {exc!r}")
            try:
                parent, attribute, current = _wrapt().resolve_path(module, spec.qualname)
            except Exception as exc:  # noqa: BLE001 - any failure to reach the target is drift
                return self._fail(group, specs, spec, f"target not found: {exc}")
            if getattr(current, MARKER, None) == spec.name:
                # Already ours (a second engine, or a re-import): adopt it, never wrap twice.
                original = current.__wrapped__
                self._installed[spec.name] = _Installed(parent, attribute, original, True)
                self._replacement[spec.name] = current
                self._set(spec, APPLIED, "already applied in this process")
                continue
            try:
                # Another group's patch may already sit on this attribute: we wrap it, but judge
                # the target by vllm-ascend's / vLLM's own function under it.
                base = _innermost(current)
                upstream = spec.fixed_upstream(base) if spec.fixed_upstream else None
                problem = spec.precondition(base) if spec.precondition else None
            except Exception as exc:  # noqa: BLE001
                return self._fail(group, specs, spec, f"precondition raised {exc!r}")
            if upstream:
                fixed.append((spec, upstream))
                continue
            if problem:
                return self._fail(group, specs, spec, f"target changed: {problem}")
            plan.append((spec, parent, attribute, current))
        if self._late and plan:
            copies = _unknown_copies({id(current): spec for spec, _p, _a, current in plan}, self._alias_paths)
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
                replacement = spec.factory(current)
                try:
                    setattr(replacement, MARKER, spec.name)
                    replacement.__wrapped__ = current
                except (AttributeError, TypeError) as exc:
                    raise TypeError(f"cannot tag the replacement for {spec.target}: {exc}") from exc
                inst = _Installed(parent, attribute, current, _defined_here(parent, attribute))
                _wrapt().apply_patch(parent, attribute, replacement)
                self._installed[spec.name] = inst
                self._replacement[spec.name] = replacement
                done.append(spec)
        except Exception as exc:  # noqa: BLE001 - roll back: nothing half-applied
            for spec in reversed(done):
                self._restore(self._installed.pop(spec.name))
                del self._replacement[spec.name]
            failing = plan[len(done)][0] if len(done) < len(plan) else specs[0]
            return self._fail(group, specs, failing, f"install failed: {exc!r}")

        for spec, _parent, _attribute, _current in plan:
            self._set(spec, APPLIED, "applied late (after the target was imported)" if self._late else "")
        for spec, why in fixed:
            self._set(spec, SKIPPED, f"already fixed upstream: {why}")
        applied = [spec.name for spec, *_ in plan]
        if applied:
            logger().info("ascend_layerwise_patch: applied %s", ", ".join(applied))
        return []

    def _fail(self, group: str, specs: list[PatchSpec], culprit: PatchSpec, reason: str) -> list[PatchStatus]:
        for spec in specs:
            if spec is culprit:
                self._set(spec, FAILED, reason)
            else:
                self._set(spec, FAILED, f"group {group} left unpatched: {culprit.name} failed")
        logger().warning(
            "ascend_layerwise_patch: group %s left unpatched: %s: %s", group, culprit.name, reason
        )
        return [self._status[s.name] for s in specs]

    # ------------------------------------------------------------------ aliases
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
                if spec.name not in self._replacement:
                    break
                original = self._installed[spec.name].original
                ours = self._replacement[spec.name]
                module_name, qual = _split(alias)
                module = _module_ready(module_name)
                if just_imported is not None and module_name == just_imported.__name__:
                    module = just_imported
                if module is None:
                    continue
                try:
                    parent, attribute, current = _wrapt().resolve_path(module, qual)
                except Exception:  # noqa: BLE001 - the copy does not exist in this version
                    self._places[(spec.name, alias)] = (SKIPPED, f"{module_name} has no {qual} in this version")
                    continue
                if current is original:
                    try:
                        place = _Installed(parent, attribute, original, _defined_here(parent, attribute))
                        _wrapt().apply_patch(parent, attribute, ours)
                    except Exception as exc:  # noqa: BLE001
                        failed += self._take_back(spec, alias, f"copy {alias} could not be patched: {exc!r}")
                        continue
                    self._aliases[(spec.name, alias)] = place
                    current = ours
                if current is ours:
                    self._places[(spec.name, alias)] = (APPLIED, "")
                    if alias not in self._status[spec.name].aliases:
                        self._status[spec.name].aliases.append(alias)
                elif spec.copied_by:
                    waiting = [m for m in spec.copied_by if m not in sys.modules]
                    self._places[(spec.name, alias)] = (
                        (PENDING, f"holds {_describe(current)} until {', '.join(waiting)} copies the target here")
                        if waiting
                        else (SKIPPED, f"holds {_describe(current)}, not a copy of the target; left as is")
                    )
                else:
                    failed += self._take_back(
                        spec, alias, f"copy {alias} holds {_describe(current)}, neither the original nor this patch"
                    )
        return failed

    def _take_back(self, culprit: PatchSpec, alias: str, reason: str) -> list[PatchStatus]:
        """A copy could not be patched: undo the whole group (all-or-nothing) and fail it."""
        specs = self.groups()[culprit.group]
        for spec in specs:
            if spec.name not in self._replacement:
                continue
            ours, inst = self._replacement.pop(spec.name), self._installed.pop(spec.name)
            for key in [key for key in self._aliases if key[0] == spec.name]:
                place = self._aliases.pop(key)
                if self._raw(place.parent, place.attribute) is ours:
                    self._restore(place)
            self._restore_aliases_copied_by_others(spec, ours, inst.original)
            if self._raw(inst.parent, inst.attribute) is ours:
                self._restore(inst)
            self._status[spec.name].aliases = []
            for key in [key for key in self._places if key[0] == spec.name]:
                del self._places[key]
        self._places[(culprit.name, alias)] = (FAILED, reason)
        return self._fail(culprit.group, specs, culprit, reason)

    def _restore_aliases_copied_by_others(self, spec: PatchSpec, ours: Any, original: Any) -> None:
        """Copies of our replacement made by someone else's ``from x import f`` go back too."""
        for alias in self._alias_paths[spec.name]:
            module = _module_ready(_split(alias)[0])
            if module is None:
                continue
            try:
                parent, attribute, current = _wrapt().resolve_path(module, _split(alias)[1])
            except Exception:  # noqa: BLE001
                continue
            if current is ours:
                _wrapt().apply_patch(parent, attribute, original)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _raw(parent: Any, attribute: str) -> Any:
        if isinstance(parent, type):
            for cls in parent.__mro__:
                if attribute in vars(cls):
                    return vars(cls)[attribute]
        return getattr(parent, attribute, None)

    @staticmethod
    def _restore(place: _Installed) -> None:
        if place.defined_here:
            setattr(place.parent, place.attribute, place.original)
        else:
            delattr(place.parent, place.attribute)

    def _set(self, spec: PatchSpec, state: str, reason: str) -> None:
        st = self._status[spec.name]
        st.state, st.reason = state, reason

    def _log_when_vllm_logs(self, level: str, msg: str, *args: Any) -> None:
        """Log through vLLM's logger: now if vLLM's logging is set up, else once it is."""
        if self._vllm_logger_pending():
            _wrapt().when_imported("vllm.logger")(lambda _module: getattr(logger(), level)(msg, *args))
        else:
            getattr(logger(), level)(msg, *args)

    def _vllm_logger_pending(self) -> bool:
        vllm = self._versions.get("vllm")
        return vllm is not None and vllm.raw is not None and "vllm.logger" not in sys.modules

    def _maybe_summarize(self, _module: Any = None) -> None:
        """The summary line, once the states settle (no patch pending), and again only when a
        state changes after that (a late failure, a conflict, a revert)."""
        with self._lock:
            if any(self._unsettled(spec) for spec in self.specs):
                return
            shown = tuple((st.name, st.state) for st in self._status.values())
            if shown == self._summarized:
                return
            if self._vllm_logger_pending():
                if not self._summary_waits:
                    self._summary_waits = True
                    _wrapt().when_imported("vllm.logger")(self._maybe_summarize)
                return
            self._summarized = shown
            self.log_summary()

    def _unsettled(self, spec: PatchSpec) -> bool:
        """Pending, and its target may still be imported in this process. A spec whose
        ``copied_by`` modules all ran without importing its target will not see it imported by
        vllm-ascend's own flow (the 310P GDN class on any other NPU): that counts as settled."""
        if self._status[spec.name].state != PENDING:
            return False
        if spec.copied_by and spec.module not in sys.modules and all(m in sys.modules for m in spec.copied_by):
            return False
        return True

    def log_summary(self) -> None:
        """One line per process: versions, then every patch's state (with reasons if not applied)."""
        with self._lock:
            parts = []
            for st in self._status.values():
                parts.append(st.name if st.state == APPLIED else f"{st.name}={st.state}({st.reason})")
            vers = ", ".join(f"{k} {v}" for k, v in self._versions.items())
        logger().info("ascend_layerwise_patch [%s]: %s", vers, "; ".join(parts))


def _raise_failures(statuses: Iterable[PatchStatus]) -> None:
    """Strict mode: one PatchError naming every failed patch and why."""
    failures = [st for st in statuses if st.state == FAILED]
    if failures:
        raise PatchError("; ".join(f"{st.name}: {st.reason}" for st in failures))


def _innermost(obj: Any) -> Any:
    """What is under every replacement of ours stacked on one attribute (patches of different
    groups may share a target; each wraps what it finds)."""
    while getattr(obj, MARKER, None) is not None and getattr(obj, "__wrapped__", None) is not None:
        obj = obj.__wrapped__
    return obj


def _describe(obj: Any) -> str:
    module = getattr(obj, "__module__", None)
    qual = getattr(obj, "__qualname__", None) or type(obj).__name__
    return f"{module}.{qual}" if module else repr(obj)


def _unknown_copies(originals: dict[int, PatchSpec], aliases: Mapping[str, Iterable[str]]) -> tuple[PatchSpec, list[str]] | None:
    """The first spec whose original is held by name in a module other than its target's and its
    known aliases', with those places; one pass over ``sys.modules`` for the whole group."""
    found: dict[int, list[str]] = {}
    wanted = set(originals)
    for name, module in list(sys.modules.items()):
        values = getattr(module, "__dict__", None)
        if values is None:
            continue
        try:
            hits = [(attr, id(v)) for attr, v in values.items() if id(v) in wanted]
        except RuntimeError:  # the module's namespace changed while we read it: read a copy
            hits = [(attr, id(v)) for attr, v in list(values.items()) if id(v) in wanted]
        for attr, key in hits:
            spec = originals[key]
            if name != spec.module and name not in {_split(a)[0] for a in aliases[spec.name]}:
                found.setdefault(key, []).append(f"{name}.{attr}")
    for key, names in found.items():
        return originals[key], names
    return None


def copies_in_source(package: str, module: str, names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """For each of ``names``: ``"mod:bound"`` for every module-level ``from <module> import <name>
    [as bound]`` in the source files of the installed ``package`` (read, never imported).

    This is how a patch finds the copies an installed release makes of its target, rather than
    relying on a hard-coded list alone. Imports inside functions and classes bind locals and are
    ignored; those under ``if`` / ``try`` at module level count. (A text scan: parsing every
    matching file with ``ast`` costs ~0.2 s, too much for each process vLLM starts.)
    """
    spec = importlib.util.find_spec(package)
    wanted = set(names)
    found: dict[str, list[str]] = {name: [] for name in wanted}
    statement = re.compile(r"^([ \t]*)from[ \t]+" + re.escape(module) + r"[ \t]+import[ \t]*(\([^)]*\)|[^\n]*)", re.M)
    for root_dir in (spec.submodule_search_locations or []) if spec else []:
        for dirpath, dirnames, filenames in os.walk(root_dir):
            dirnames.sort()
            for filename in sorted(f for f in filenames if f.endswith(".py")):
                path = os.path.join(dirpath, filename)
                with open(path, encoding="utf-8", errors="replace") as fh:
                    text = fh.read()
                if module not in text:
                    continue
                rel = os.path.relpath(path, root_dir)[: -len(".py")].split(os.sep)
                importer = ".".join([package, *(rel[:-1] if rel[-1] == "__init__" else rel)])
                for match in statement.finditer(text):
                    if match.group(1) and not _module_level(text, match.start()):
                        continue
                    listed = re.sub(r"#[^\n]*", "", match.group(2)).strip("()\\ \t\n")
                    for item in listed.replace("\\\n", " ").split(","):
                        name, _, bound = item.strip().partition(" as ")
                        if name.strip() in wanted:
                            found[name.strip()].append(f"{importer}:{(bound or name).strip()}")
    return {name: tuple(dict.fromkeys(paths)) for name, paths in found.items()}


def _module_level(text: str, pos: int) -> bool:
    """Whether the indented statement at ``pos`` runs at import time (no ``def`` / ``class`` encloses it)."""
    lines = text[:pos].splitlines()
    indent = len(text[pos:]) - len(text[pos:].lstrip(" \t"))
    for line in reversed(lines):
        stripped = line.lstrip(" \t")
        if not stripped or stripped.startswith("#"):
            continue
        depth = len(line) - len(stripped)
        if depth < indent:
            if stripped.startswith(("def ", "async def ", "class ")):
                return False
            indent = depth
            if depth == 0:
                return True
    return True
