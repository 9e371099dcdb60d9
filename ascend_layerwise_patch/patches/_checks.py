"""Helpers shared by the patch modules' target checks."""

from __future__ import annotations

import functools


def with_risk(check, risk: str):
    """``check`` whose failure also says what stays unfixed (the registry shows it in ``status()``)."""

    def checked(original) -> str | None:
        problem = check(original)
        return f"{problem}; {risk}" if problem else None

    return checked


@functools.lru_cache(maxsize=64)  # the detectors of one group read the same class sources
def source(obj) -> str:
    """``obj``'s source, or "" where there is none (built-ins, generated code)."""
    import inspect  # lazy: kept off the import path

    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def param_names(fn) -> list[str]:
    """The parameter names of ``fn``, in order."""
    import inspect

    return list(inspect.signature(fn).parameters)


def expects(params: list[str], *, needs: tuple[str, ...] = (), globals_: tuple[str, ...] = ()):
    """A precondition: these parameters, these names in the source, these module globals."""

    def check(original) -> str | None:
        got = param_names(original)
        if got != params:
            return f"{original.__qualname__} parameters are {got}, expected {params}"
        text = source(original)
        missing = [n for n in needs if text and n not in text]
        if missing:
            return f"{original.__qualname__} no longer uses {', '.join(missing)}"
        absent = [n for n in globals_ if n not in original.__globals__]
        if absent:
            return f"{original.__module__} no longer defines/imports {', '.join(absent)}"
        return None

    return check
