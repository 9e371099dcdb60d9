"""The table of every patch's expected state per pair (scripts/expected_states.txt), and the
list of groups (rendered from the index, patches/__init__.py's docstring): docs/patches.md shows both.

    python scripts/expected_states.py            print the expected-states table (markdown)
    python scripts/expected_states.py --readme   rewrite both generated blocks in place, in the file
                                                 of README.md and docs/*.md that holds each one's
                                                 markers (today docs/patches.md)

The tests read the table through :func:`load` and :func:`code_of` (tests/support.py): each pair's
``check --cpu --json`` must match its column, and the docs must hold :func:`markdown`'s output.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "scripts" / "expected_states.txt"
PAIRS = ROOT / "scripts" / "pairs.txt"
BEGIN, END = "<!-- expected-states: begin (scripts/expected_states.py --readme) -->", "<!-- expected-states: end -->"
GROUPS_BEGIN, GROUPS_END = "<!-- patch-groups: begin (scripts/expected_states.py --readme) -->", "<!-- patch-groups: end -->"
INDEX = ROOT / "ascend_layerwise_patch" / "patches" / "__init__.py"
WORDS = {
    "applied": "applied",
    "fixed": "fixed upstream",
    "ported": "ported (its fix for this pair applies)",
    "range": "out of range",
    "noimport": "does not import",
}


def doc_files() -> list[Path]:
    """README.md and docs/*.md: the files a generated block may live in."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def holder(begin: str) -> Path:
    """The one file of :func:`doc_files` that holds the block whose first line is ``begin``."""
    found = [path for path in doc_files() if begin in path.read_text()]
    if len(found) != 1:
        names = [str(path.relative_to(ROOT)) for path in found]
        raise ValueError(f"{begin} is in {names or 'none of README.md, docs/*.md'}: want exactly one file")
    return found[0]


def rewrite(block: str, begin: str, end: str) -> Path:
    """Puts ``block`` in place of the one between ``begin`` and ``end`` (markers included), in the
    file that holds them; returns that file."""
    path = holder(begin)
    text = path.read_text()
    start, stop = text.index(begin), text.index(end) + len(end)
    path.write_text(text[:start] + block + text[stop:])
    return path


def load(path: Path = TABLE) -> tuple[list[str], dict[str, dict[str, str]]]:
    """(pair names in column order, {patch: {pair: code}}), patches in the file's order."""
    lines = [line.split() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    header, rows = lines[0], lines[1:]
    assert header[0] == "patch", header
    pairs = header[1:]
    table: dict[str, dict[str, str]] = {}
    for row in rows:
        if len(row) != len(header) or any(code not in WORDS for code in row[1:]):
            raise ValueError(f"{path}: bad row {row} (want a patch name and one of {sorted(WORDS)} per pair)")
        table[row[0]] = dict(zip(pairs, row[1:]))
    return pairs, table


def code_of(state: str, reason: str) -> str:
    """The table's code for a patch's state and reason from ``check --json``."""
    if state == "applied":
        return "applied"
    if state == "skipped":
        if reason.startswith("ported:"):  # out of range, with its fix for these versions named (before "range")
            return "ported"
        for code, words in (("fixed", "already fixed upstream"), ("range", "version out of range"), ("noimport", "does not import")):
            if words in reason:
                return code
    return f"{state}: {reason}"


def pair_versions() -> dict[str, tuple[str, str]]:
    out = {}
    for line in PAIRS.read_text().splitlines():
        parts = line.split()
        if parts and not parts[0].startswith("#"):
            out[parts[0]] = (parts[1], parts[2])
    return out


def markdown() -> str:
    pairs, table = load()
    versions = pair_versions()
    head = "| patch | " + " | ".join(f"{p} ({versions[p][0]} + {versions[p][1]})" for p in pairs) + " |"
    rows = [head, "|---" * (len(pairs) + 1) + "|"]
    rows += [f"| `{name}` | " + " | ".join(WORDS[codes[p]] for p in pairs) + " |" for name, codes in table.items()]
    return "\n".join(rows)


def readme_block() -> str:
    return f"{BEGIN}\n{markdown()}\n{END}"


def groups() -> list[tuple[str, str, str]]:
    """(group, package, what it fixes) for each line of the index, read from the source (not imported)."""
    import ast

    lines = ast.get_docstring(ast.parse(INDEX.read_text())).splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:3] == ["group", "package", "what"])
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        group, package, what = line.split(None, 2)
        rows.append((group, package, what.strip()))
    return rows


def groups_block(where: Path | None = None) -> str:
    """The list of groups, its links relative to ``where`` (default: the file that holds the block now)."""
    up = os.path.relpath(ROOT, (where or holder(GROUPS_BEGIN)).parent)
    base = "" if up == "." else up.replace(os.sep, "/") + "/"
    rows = ["| group | package (its docstring is the group's text) | what it fixes |", "|---|---|---|"]
    rows += [
        f"| `{group}` | [`{package}`]({base}ascend_layerwise_patch/patches/{package}/__init__.py) | {what} |"
        for group, package, what in groups()
    ]
    return f"{GROUPS_BEGIN}\n" + "\n".join(rows) + f"\n{GROUPS_END}"


def main(argv: list[str]) -> int:
    if argv == ["--readme"]:
        rewrite(readme_block(), BEGIN, END)
        rewrite(groups_block(), GROUPS_BEGIN, GROUPS_END)
        return 0
    print(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
