"""Helpers shared by the patch modules' target checks."""

from __future__ import annotations


def with_risk(check, risk: str):
    """``check`` whose failure also says what stays unfixed (the registry shows it in ``status()``)."""

    def checked(original) -> str | None:
        problem = check(original)
        return f"{problem}; {risk}" if problem else None

    return checked
