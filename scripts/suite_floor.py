"""The least number of tests a matrix suite must run on a pair; scripts/matrix.sh asks after each suite.

    python scripts/suite_floor.py SUITE PAIR LOG    SUITE: unit, ascend_compile, standins or interp;
                                                    PAIR: a column of scripts/expected_states.txt
                                                    (- for the suites that run once); LOG: that
                                                    pytest run's output

prints one line (the tests run against the floor, and why that floor) and exits 1 when the run
ran fewer tests than its floor: a suite whose tests are all skipped or deselected, or that
collected nothing, does not pass by exiting 0.

The floors come from the expected-states table: every suite must run at least one test, except
tests/interp on a pair where the table does not mark ``postprocess_kernel`` applied (the
library's kernel is never installed there, so its interpreter tests may all skip: vllm-ascend
0.30.0rc2's own kernel takes vLLM's parameters).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import expected_states  # noqa: E402

#: what a pytest run counts as run (skipped and deselected tests did not run)
RAN = ("passed", "failed", "xfailed", "xpassed")
SUMMARY = re.compile(r"(?:\d+ (?:passed|failed|skipped|xfailed|xpassed|deselected|errors?|warnings?)|no tests ran)\b.* in [\d.]+s")


def floor(suite: str, pair: str, table: dict[str, dict[str, str]] | None = None) -> tuple[int, str]:
    """(least tests to run, why) for ``suite`` on ``pair``."""
    if suite != "interp":
        return 1, f"every {suite} run must run a test"
    code = (table if table is not None else expected_states.load()[1])["postprocess_kernel"][pair]
    word = expected_states.WORDS[code]
    if code == "applied":
        return 1, f"postprocess_kernel is applied on {pair} (scripts/expected_states.txt): its kernel must be tested"
    return 0, f"postprocess_kernel is {word} on {pair} (scripts/expected_states.txt): the library's kernel is not installed there"


def counts(log: str) -> dict[str, int] | None:
    """pytest's final counts ({"passed": 5, "skipped": 2, ...}) from a run's output; None if none."""
    lines = [line for line in log.splitlines() if SUMMARY.search(line)]
    if not lines:
        return None
    found = {}
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|xfailed|xpassed|deselected|errors?)\b", lines[-1]):
        found[word.rstrip("s") if word.startswith("error") else word] = int(number)
    return found


def verdict(suite: str, pair: str, log: str, table: dict[str, dict[str, str]] | None = None) -> tuple[bool, str]:
    least, why = floor(suite, pair, table)
    found = counts(log)
    if found is None:
        return False, f"no pytest summary line in the output (it crashed or collected nothing); {why}"
    ran = sum(found.get(word, 0) for word in RAN)
    seen = ", ".join(f"{n} {word}" for word, n in found.items()) or "nothing"
    if ran < least:
        return False, f"FAILED: ran {ran} tests ({seen}), at least {least} expected: {why}"
    return True, f"ran {ran} tests ({seen}); at least {least}: {why}"


def main(argv: list[str]) -> int:
    suite, pair, log = argv
    ok, line = verdict(suite, pair, Path(log).read_text(errors="replace"))
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
