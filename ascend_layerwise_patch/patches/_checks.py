"""Helpers shared by the patch modules: a group's declaration (:class:`Group`), target checks."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import threading
from collections.abc import Callable, Iterable

from ..registry import Expect
from ..registry import PatchSpec as _Spec
from ._ranges import Ranges


class Group(str):
    """One group, declared once: its name (a group *is* its name: ``ASCEND_LAYERWISE_PATCH_SKIP``,
    ``PatchStatus.group`` and ``Context.in_force`` take it as is), the releases it is declared for
    (one of ``_ranges``), what stays unfixed when it cannot apply (``risk``), and whatever else all
    its patches share (``why``, ``fixed_upstream``, ...: :class:`~ascend_layerwise_patch.registry.PatchSpec`
    fields). :meth:`spec` declares one of its patches."""

    ranges: Ranges
    shared: dict

    def __new__(cls, name: str, ranges: Ranges, *, risk: str = "", **shared):
        group = super().__new__(cls, name)
        group.ranges, group.shared = ranges, {"risk": risk, **shared}
        return group

    def spec(self, name: str, target: str, factory, *, ranges: Ranges | None = None, **fields) -> _Spec:
        """A :class:`~ascend_layerwise_patch.registry.PatchSpec` of this group: the group's fields,
        then the patch's own (``ranges``: a member declared for fewer releases than its group). A
        ``precondition`` that is an :class:`~ascend_layerwise_patch.registry.Expect` (what
        :func:`expects` returns) is declared as the spec's ``expects``: data, checked by the registry."""
        fields = {**self.shared, **fields}
        # ported_to: (Ranges, where) pairs, declared like the group's own ranges
        fields["ported_to"] = tuple(({"vllm": r.vllm, "vllm_ascend": r.vllm_ascend}, where) for r, where in fields.get("ported_to", ()))
        if isinstance(fields.get("precondition"), Expect):
            fields["expects"] = fields.pop("precondition")
        vllm, vllm_ascend = ranges or self.ranges
        requires = {"vllm": vllm, "vllm_ascend": vllm_ascend}
        return _Spec(name=name, group=str(self), target=target, factory=factory, requires=requires, **fields)


    def vouched(self, name: str, target: str, detector, *, ranges: Ranges, what: str, after: tuple[str, ...] = ()) -> _Spec:
        """A member that applies nothing: on ``ranges`` (releases that reworked the group's targets)
        it reads the release's own fix of the group's defect at ``target`` (``detector``: the reason
        when found) and is skipped as fixed upstream. Where the detector no longer finds the fix the
        group fails with that message and its risk: the release changed and nobody has checked it
        again. The group's other members name it in ``ported_to`` for those releases."""

        def gone(_original) -> str:
            return f"{what} is no longer found in the installed code"

        def never_applied(_original):  # its precondition fails before it could run
            raise AssertionError(f"{name} (a vouched member) is never applied")

        never_applied.__module__ = detector.__module__  # the member belongs to its group's package
        return self.spec(
            name, target, never_applied, ranges=ranges, fixed_upstream=detector, precondition=gone, why=what, after=after
        )


@functools.lru_cache(maxsize=64)  # the detectors of one group read the same class sources
def source(obj) -> str:
    """``obj``'s source, or "" where there is none (built-ins, generated code)."""
    import inspect  # lazy: kept off the import path

    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def syntax_tree(obj):
    """``obj``'s source parsed (``ast``), or ``None`` where there is no source or it does not parse."""
    import ast
    import textwrap

    text = source(obj)
    try:
        return ast.parse(textwrap.dedent(text)) if text else None
    except SyntaxError:
        return None


def param_names(fn) -> list[str]:
    """The parameter names of ``fn``, in order."""
    import inspect

    return list(inspect.signature(fn).parameters)


def expects(params: list[str], *, needs: tuple[str, ...] = (), globals_: tuple[str, ...] = ()) -> Expect:
    """What a target must look like, as data: these parameters, these names in its source, these
    module globals. Declared on a spec (``precondition=expects(...)``) or called on a target inside a
    larger check (``expects(...)(original)`` is the problem, or ``None``)."""
    return Expect(tuple(params), tuple(needs), tuple(globals_))


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


# Shared by the load-failure rollbacks of 0.25 (load_failures) and 0.30 (pool_load_recovery): vLLM's
# scheduler and vllm-ascend's pool scheduler, as both releases' rollbacks find them.
SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"


def lookup(path: str):
    """The object a ``"module:Qual.name"`` target path names, its module imported."""
    module, _, qual = path.partition(":")
    obj = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def upstream_preempts(handle_invalid) -> str | None:
    """Fixed upstream when ``Scheduler._handle_invalid_blocks`` preempts the affected requests itself."""
    if "_preempt_request" in source(handle_invalid):
        return "Scheduler._handle_invalid_blocks preempts the affected requests itself"
    return None


def detect_at(path: str, detector: Callable[[object], str | None]) -> Callable[[object], str | None]:
    """A spec's ``fixed_upstream`` that runs ``detector`` on another target (``path``, looked up when
    the check runs): the patches of one group skip together when the fix shows in one place."""

    def detect(_original) -> str | None:
        return detector(lookup(path))

    detect.__name__ = detect.__qualname__ = f"{getattr(detector, '__name__', 'detector')}_at"
    return detect


#: ``upstream_preempts`` of the installed scheduler, for a spec on another target
upstream_preempts_any = detect_at(f"{SCHEDULER}._handle_invalid_blocks", upstream_preempts)


def upstream_keeps_resumed(build_meta) -> str | None:
    """Fixed upstream when ``KVPoolScheduler.build_connector_meta`` tells a preempted request from a
    resumed one itself."""
    if "resumed_req_ids" in source(build_meta):
        return "KVPoolScheduler.build_connector_meta tells a preempted request from a resumed one itself"
    return None


def build_meta_expects(*needs: str) -> Expect:
    """``KVPoolScheduler.build_connector_meta`` as the resumed-preemption wrappers find it: it walks
    ``preempted_req_ids`` and drops the request's entries (``needs``: the release's extra names)."""
    return expects(
        ["self", "scheduler_output"],
        needs=(
            "for req_id in scheduler_output.preempted_req_ids",
            "self._unfinished_requests.pop(req_id, None)",
            "_preempted_req_ids",
            "_request_trackers",
            "_loading_req_ids",
            *needs,
        ),
    )


class Counts:
    """A patch's live counts (``PatchSpec.counters = counts.snapshot``): named integers bumped from
    any thread (scheduler, worker, transfer threads)."""

    def __init__(self, *names: str):
        self._counts = dict.fromkeys(names, 0)
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
