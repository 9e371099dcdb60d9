"""What a patch is (:class:`PatchSpec`, declared as data) and what it became (:class:`PatchStatus`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

#: every replacement carries the name of its spec under this attribute (and ``__wrapped__``)
MARKER = "__ascend_layerwise_patch__"

APPLIED = "applied"
PENDING = "pending"
SKIPPED = "skipped"
FAILED = "failed"
CONFLICT = "conflict"
REVERTED = "reverted"
#: how a skipped patch's reason starts when its detector found the fix in the installed code
FIXED_UPSTREAM = "already fixed upstream"
#: how a skipped patch's reason starts when it is out of range where its ``ported_to`` names the code
#: that carries its fix on those versions
PORTED = "ported"

Check = Callable[[Any], "str | None"]


class PatchError(RuntimeError):
    """Raised in strict mode when a patch that is in range cannot be applied."""


class Expect(NamedTuple):
    """What a patch expects of its target, as data: its parameter names in order, names its source
    uses, names its module defines or imports. :meth:`problem` says what differs (``None``: as expected)."""

    params: tuple[str, ...] | None = None
    uses: tuple[str, ...] = ()
    module_globals: tuple[str, ...] = ()

    def problem(self, original: Any) -> str | None:
        import inspect  # lazy: kept off the import path

        if self.params is not None:
            got = list(inspect.signature(original).parameters)
            if got != list(self.params):
                return f"{original.__qualname__} parameters are {got}, expected {list(self.params)}"
        if self.uses:
            try:
                text = inspect.getsource(original)
            except (OSError, TypeError):
                text = ""  # no source (built-in, generated): the parameters are all that can be checked
            missing = [name for name in self.uses if text and name not in text]
            if missing:
                return f"{original.__qualname__} no longer uses {', '.join(missing)}"
        absent = [name for name in self.module_globals if name not in original.__globals__]
        if absent:
            return f"{original.__module__} no longer defines/imports {', '.join(absent)}"
        return None

    __call__ = problem  # an Expect is also a check: ``Expect(...)(original)``


class PatchSpec(NamedTuple):
    """One patch, declared as data.

    ``target`` and each alias are ``"package.module:Qualified.name"``. ``factory(original)``
    returns what is installed in place of ``original``. ``precondition(original)`` and
    ``fixed_upstream(original)`` return ``None`` when all is well, else the reason (a target that
    drifted fails the whole group; a target that already carries the fix is skipped).
    ``requires`` maps each distribution (the host's key) to a PEP 440 range matched on the base
    release (see ``versions``). ``copied_by`` names
    modules whose import copies the target into an alias (a package's own late patches):
    their import re-points the aliases, whatever the order. ``find_aliases()``, called once at
    activation, returns more alias paths found in what is installed. Patches of different groups
    may target the same attribute: the later one wraps the earlier one's replacement, its checks
    see the original under both, and ``revert()`` takes them off newest first. ``counters()``, if
    given, returns the patch's live counts in this process (shown in ``status()`` while it is
    applied).
    """

    name: str
    group: str
    target: str
    factory: Callable[[Any], Any]
    why: str
    #: the version each distribution must have, by the host's key (PEP 440 specifiers on the base
    #: release); ``None`` for a key: does not depend on that one
    requires: Mapping[str, str | None] = {}
    aliases: tuple[str, ...] = ()
    copied_by: tuple[str, ...] = ()
    precondition: Check | None = None
    fixed_upstream: Check | None = None
    find_aliases: Callable[[], Iterable[str]] | None = None
    counters: Callable[[], Mapping[str, int]] | None = None
    #: ``factory(original, context)`` instead: a :class:`Context`, read-only, for a patch whose
    #: behaviour depends on another group's state in this process (it never imports the registry)
    context: bool = False
    #: what the target must look like (checked before ``precondition``; a difference fails the group)
    expects: Expect | None = None
    #: what stays unfixed when this patch cannot apply: appended to a failed check's reason
    risk: str = ""
    #: the patches (by name) this one is stacked on: every earlier spec of the same target must be
    #: named here (two patches on one attribute say so, and in which order they wrap)
    after: tuple[str, ...] = ()
    #: releases out of ``requires`` on which another group (or other members of this one) carries
    #: this patch's fix, rewritten for that release: ``(requires, "where")`` pairs. Out of range there,
    #: the patch is skipped with a reason that starts ``ported:`` and names ``where`` (not a bare
    #: "out of range": the defect is handled on that pair, by the code named)
    ported_to: tuple[tuple[Mapping[str, str | None], str], ...] = ()

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def qualname(self) -> str:
        return self.target.partition(":")[2]


class Context:
    """What a factory may read of the registry (``PatchSpec.context``): live, read-only."""

    __slots__ = ("_states",)

    def __init__(self, states: Callable[[str], frozenset]):
        self._states = states

    def group_states(self, group: str) -> frozenset:
        """The states of ``group``'s members in this process now (empty for an unknown group)."""
        return self._states(group)

    def in_force(self, group: str) -> bool:
        """Whether every member of ``group`` is applied, or waiting for its modules (none skipped,
        failed, reverted or in conflict; False for an unknown group)."""
        states = self._states(group)
        return bool(states) and states <= {APPLIED, PENDING}


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


def split_path(path: str) -> tuple[str, str]:
    """``"package.module:Qualified.name"`` -> (module, qualified name); anything else is a ValueError."""
    module, _, qual = path.partition(":")
    if not module or not qual:
        raise ValueError(f"patch path {path!r} must look like 'package.module:Qualified.name'")
    return module, qual


def check_order(specs: Iterable[PatchSpec]) -> None:
    """Patches stacked on one target declare it: each names every earlier spec of its target in
    ``after``, and ``after`` names only earlier specs of the same target. Else a ValueError."""
    earlier: dict[str, list[str]] = {}
    for spec in specs:
        below = earlier.setdefault(spec.target, [])
        undeclared = [name for name in below if name not in spec.after]
        unknown = [name for name in spec.after if name not in below]
        if undeclared or unknown:
            raise ValueError(
                f"patch {spec.name!r} on {spec.target}: after={spec.after!r}, but the earlier patches of that "
                f"target are {below!r} (stacked patches name every earlier one, in the order they are applied)"
            )
        below.append(spec.name)


def raise_failures(statuses: Iterable[PatchStatus]) -> None:
    """Strict mode: one PatchError naming every failed patch and why."""
    failures = [st for st in statuses if st.state == FAILED]
    if failures:
        raise PatchError("; ".join(f"{st.name}: {st.reason}" for st in failures))


class Host(NamedTuple):
    """What the registry needs of the process it patches, given by the package that uses it.

    ``detect()``: the installed version of each distribution a spec's ``requires`` names, by key
    (``versions.Installed``); ``logger()``: where to log; ``logs_later(installed)``: whether the
    host's logging is not set up yet, in which case lines wait for ``logging_module`` to be
    imported (so they come out in the host's format)."""

    detect: Callable[[], Mapping[str, Any]]
    logger: Callable[[], Any]
    logging_module: str | None = None
    logs_later: Callable[[Mapping[str, Any]], bool] = lambda _installed: False


def _plain_logger():
    import logging

    return logging.getLogger("ascend_layerwise_patch")


#: a host that detects nothing and logs through the standard logging module
PLAIN = Host(detect=dict, logger=_plain_logger)
