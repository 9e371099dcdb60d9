"""Putting replacements in place and taking them back off, exactly.

Replacements are installed with plain ``setattr`` on the raw attribute that wrapt's
``resolve_path`` finds (the MRO's ``vars()``, not a bound method). :class:`Places` remembers, for
every spec, the target it replaced and each copy (``from x import f``) it re-pointed, and
:meth:`Places.undo` is the one way back for ``revert()`` and for a group taken back off.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from .spec import MARKER, split_path


def wrapt():
    """wrapt, imported on first use: it pulls in asyncio and importlib.metadata (~35 ms in a
    fresh interpreter), which vLLM imports anyway but a bare ``import ascend_layerwise_patch``
    should not pay for."""
    import wrapt as _wrapt

    return _wrapt


class Installed(NamedTuple):
    """Book-keeping for one place we replaced: enough to undo it exactly."""

    parent: Any
    attribute: str
    original: Any
    defined_here: bool


def module_ready(name: str) -> types.ModuleType | None:
    """The module if it is imported and finished executing, else ``None``."""
    module = sys.modules.get(name)
    if module is None:
        return None
    spec = getattr(module, "__spec__", None)
    if spec is not None and getattr(spec, "_initializing", False):
        return None
    return module


def resolve(module: types.ModuleType, qual: str) -> tuple[Any, str, Any]:
    """(parent, attribute, current value) of ``qual`` in ``module`` (raises if it is not there)."""
    return wrapt().resolve_path(module, qual)


def raw(parent: Any, attribute: str) -> Any:
    """The attribute as stored (a class's ``vars()`` along the MRO: no bound method)."""
    if isinstance(parent, type):
        for cls in parent.__mro__:
            if attribute in vars(cls):
                return vars(cls)[attribute]
    return getattr(parent, attribute, None)


def innermost(obj: Any) -> Any:
    """What is under every replacement of ours stacked on one attribute (patches of different
    groups may share a target; each wraps what it finds)."""
    while getattr(obj, MARKER, None) is not None and getattr(obj, "__wrapped__", None) is not None:
        obj = obj.__wrapped__
    return obj


def describe(obj: Any) -> str:
    module = getattr(obj, "__module__", None)
    qual = getattr(obj, "__qualname__", None) or type(obj).__name__
    return f"{module}.{qual}" if module else repr(obj)


def _place(parent: Any, attribute: str, original: Any, value: Any) -> Installed:
    defined_here = attribute in vars(parent) if isinstance(parent, type) else hasattr(parent, attribute)
    wrapt().apply_patch(parent, attribute, value)
    return Installed(parent, attribute, original, defined_here)


def _restore(place: Installed) -> None:
    if place.defined_here:
        setattr(place.parent, place.attribute, place.original)
    else:
        delattr(place.parent, place.attribute)


def tag(replacement: Any, name: str, original: Any) -> Any:
    """Mark ``replacement`` as the spec's (a second activation recognises it by identity)."""
    try:
        setattr(replacement, MARKER, name)
        replacement.__wrapped__ = original
    except (AttributeError, TypeError) as exc:
        raise TypeError(f"cannot tag the replacement of {describe(original)}: {exc}") from exc
    return replacement


class Places:
    """Every place each spec holds: its target (in installation order) and its copies."""

    def __init__(self) -> None:
        self._target: dict[str, Installed] = {}
        self._ours: dict[str, Any] = {}
        self._copies: dict[tuple[str, str], Installed] = {}

    def holds(self, name: str) -> bool:
        return name in self._ours

    def ours(self, name: str) -> Any:
        return self._ours[name]

    def original(self, name: str) -> Any:
        return self._target[name].original

    def newest_first(self) -> list[str]:
        return list(reversed(list(self._target)))

    def adopt(self, name: str, parent: Any, attribute: str, current: Any) -> None:
        """``current`` is already ours (a second engine, a re-import): take it over, unwrapped."""
        self._target[name] = Installed(parent, attribute, current.__wrapped__, True)
        self._ours[name] = current

    def install(self, name: str, parent: Any, attribute: str, current: Any, replacement: Any) -> None:
        self._target[name] = _place(parent, attribute, current, replacement)
        self._ours[name] = replacement

    def point_copy(self, name: str, alias: str, parent: Any, attribute: str) -> None:
        """A copy that holds the original now holds ours."""
        self._copies[(name, alias)] = _place(parent, attribute, self.original(name), self.ours(name))

    def undo(self, name: str, alias_paths: Iterable[str]) -> Any | None:
        """Take ``name`` off everywhere it is: its copies (also those someone else's
        ``from x import f`` made of ours, in ``alias_paths``), then its target if it still holds
        ours. Returns what replaced ours on the target since (left as is), else ``None``."""
        ours, target = self._ours.pop(name), self._target.pop(name)
        for key in [key for key in self._copies if key[0] == name]:
            place = self._copies.pop(key)
            if raw(place.parent, place.attribute) is ours:
                _restore(place)
        for alias in alias_paths:
            module = module_ready(split_path(alias)[0])
            if module is None:
                continue
            try:
                parent, attribute, current = resolve(module, split_path(alias)[1])
            except Exception:  # noqa: BLE001 - that copy does not exist in this version
                continue
            if current is ours:
                wrapt().apply_patch(parent, attribute, target.original)
        current = raw(target.parent, target.attribute)
        if current is target.original:  # an alias named the target's own place (a class re-bound
            return None  # under its name since, e.g. vllm-ascend's balance scheduler): restored there
        if current is not ours:
            return current
        _restore(target)
        return None


def unknown_copies(originals: dict[int, Any], aliases: Mapping[str, Iterable[str]]) -> tuple[Any, list[str]] | None:
    """The first spec (of ``originals``: id of an original -> its spec) whose original is held by
    name in a module other than its target's and its known aliases', with those places; one pass
    over ``sys.modules`` for the whole group."""
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
            if name != spec.module and name not in {split_path(a)[0] for a in aliases[spec.name]}:
                found.setdefault(key, []).append(f"{name}.{attr}")
    for key, names in found.items():
        return originals[key], names
    return None
