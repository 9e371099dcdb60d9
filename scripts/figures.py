"""The figures block of docs/measured.md -- times per stage, disk per environment, counts of
patches -- from one `bash scripts/matrix.sh` log and the tables the tests hold the code to.

    python scripts/figures.py MATRIX_LOG            print the block
    python scripts/figures.py MATRIX_LOG --readme   rewrite the block in place, in the file of
                                                    README.md and docs/*.md that holds its markers

From the log (scripts/matrix.sh prints these on every run): ``matrix: environments ready in N s``,
``=== NAME: exit RC in N s`` per suite, ``matrix: N pairs in N s``, ``matrix: disk: ENV SIZE`` per
environment, ``matrix: on disk: SIZE in ... (all venvs), SIZE in .bench; N cores, DATE``; and, if
the log carries a scripts/check.sh run's output too (run it first, on a clean clone, into the same
log, stdout and stderr), its ``check.sh: exit 0 in N s``. Patch
counts come from scripts/expected_states.txt, pairs from scripts/pairs.txt, groups from the index
(patches/__init__.py). tests/unit/test_figures.py checks the block against those tables and that
the prose of the README and docs/ quotes no other such figure.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import expected_states  # noqa: E402

BEGIN = "<!-- figures: begin (python scripts/figures.py MATRIX_LOG --readme) -->"
END = "<!-- figures: end -->"
UNITS = {"K": 1e-6, "M": 1e-3, "G": 1.0, "T": 1e3}


def gb(size: str) -> float:
    """``du -sh``'s ``2.4G`` / ``736M`` / ``84K`` in GB."""
    match = re.fullmatch(r"([\d.]+)([KMGT]?)", size.strip())
    if not match:
        raise ValueError(f"not a du -h size: {size!r}")
    return float(match.group(1)) * UNITS.get(match.group(2), 1e-9)


def shown(size: str) -> str:
    value = gb(size)
    return f"{value:.1f} GB" if value >= 0.1 else f"{value * 1e6:.0f} KB"


def parse(log: str) -> dict:
    """The figures of one matrix log; ValueError if a line the block needs is missing."""
    def one(pattern: str, what: str) -> re.Match:
        found = re.findall(pattern, log, re.M)
        if not found:
            raise ValueError(f"the log has no {what} line ({pattern})")
        return found[-1]

    suites = {name: int(secs) for name, rc, secs in re.findall(r"^=== (.+): exit (\d+) in (\d+) s$", log, re.M)}
    failed = re.findall(r"^=== (.+): exit ([1-9]\d*) in", log, re.M) + re.findall(r"^(?:matrix: FAILED: |=== .*: FAILED: )(.*)$", log, re.M)
    if failed:
        raise ValueError(f"the log's run failed ({failed}): figures come from a passing run")
    disk, cores, date = one(r"^matrix: on disk: (\S+) in .*?; (\d+) cores, (\S+)$", "'matrix: on disk: ...'")
    bench = re.search(r"^matrix: on disk: .*?, (\S+) in \.bench", log, re.M)
    check = re.findall(r"^check\.sh: exit 0 in (\d+) s$", log, re.M)
    total = int(one(r"^matrix: \d+ pairs in (\d+) s$", "'matrix: N pairs in N s'"))
    if not re.search(r"^matrix: all suites passed$", log, re.M):
        raise ValueError("the log has no 'matrix: all suites passed' line: figures come from a passing run")
    return {
        "envs": int(one(r"^matrix: environments ready in (\d+) s$", "'matrix: environments ready in N s'")),
        "total": total,
        "suites": suites,
        "disk": dict(re.findall(r"^matrix: disk: (\S+) (\S+)$", log, re.M)),
        "all": disk,
        "bench": bench.group(1) if bench else None,
        "cores": int(cores),
        "date": date,
        "check_sh": int(check[-1]) if check else None,
    }


def block(fig: dict) -> str:
    pairs, table = expected_states.load()
    n_groups = len(expected_states.groups())
    out = [
        BEGIN,
        f"Measured {fig['date']} on a {fig['cores']}-core CPU machine, `bash scripts/matrix.sh` (every pair of",
        "`scripts/pairs.txt`) on a clean clone; this block is written by `scripts/figures.py` from that run's log.",
        "",
        "| stage | seconds |",
        "|---|---|",
        f"| environments (base, {len(pairs)} pairs, ascendc) | {fig['envs']} |",
    ]
    for name in ("unit", "ascend compile"):
        out.append(f"| {name} | {fig['suites'][name]} |")
    for pair in pairs:
        out.append(f"| {pair} standins + interp | {fig['suites'][f'{pair} standins']} + {fig['suites'][f'{pair} interp']} |")
    out.append(f"| whole matrix (benchmark smoke runs included) | {fig['total']} ({fig['total'] / 60:.1f} min) |")
    if fig["check_sh"] is not None:
        out.append(f"| `scripts/check.sh` on a clean clone (base + {pairs[0]} environments, then `check --cpu`) | {fig['check_sh']} |")
    out += ["", "| environment | disk |", "|---|---|"]
    for env in ["base", *pairs, "ascendc"]:
        out.append(f"| `.matrix/{env}` | {shown(fig['disk'][env])} |")
    check_sh = gb(fig["disk"]["base"]) + gb(fig["disk"][pairs[0]])
    out.append(f"| `.matrix/` in all | {shown(fig['all'])} |")
    out.append(f"| `scripts/check.sh`'s part (base + {pairs[0]}) | {check_sh:.1f} GB |")
    if fig["bench"]:
        out.append(f"| `.bench/` (the two extracted kernel files) | {shown(fig['bench'])} |")
    out += ["", f"Patches: {len(table)} in {n_groups} groups.", "", "| pair | applied | fixed upstream | skipped |", "|---|---|---|---|"]
    for pair in pairs:
        codes = [row[pair] for row in table.values()]
        fixed = codes.count("fixed")
        out.append(f"| {pair} | {codes.count('applied')} | {fixed} | {len(codes) - codes.count('applied') - fixed} |")
    out.append(END)
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if not argv or len(argv) > 2 or (len(argv) == 2 and argv[1] != "--readme"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    text = block(parse(Path(argv[0]).read_text(errors="replace")))
    if argv[1:] == ["--readme"]:
        expected_states.rewrite(text, BEGIN, END)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
