"""Issue 36: every figure the README gives about the matrix -- time per stage, disk per environment,
patch counts -- sits in one block that scripts/figures.py writes from a matrix log; the block agrees
with scripts/expected_states.txt and scripts/pairs.txt, and the prose quotes no other such figure."""

from __future__ import annotations

import importlib.util
import re

import pytest

from support import ROOT

spec = importlib.util.spec_from_file_location("figures", ROOT / "scripts" / "figures.py")
figures = importlib.util.module_from_spec(spec)
spec.loader.exec_module(figures)
README = (ROOT / "README.md").read_text()


def the_block(text: str = README) -> str:
    assert text.count(figures.BEGIN) == 1 and text.count(figures.END) == 1
    return text[text.index(figures.BEGIN) : text.index(figures.END) + len(figures.END)]


def prose(text: str = README) -> str:
    """The README without the figures block and the two generated tables."""
    es = figures.expected_states
    for begin, end in ((figures.BEGIN, figures.END), (es.BEGIN, es.END), (es.GROUPS_BEGIN, es.GROUPS_END)):
        text = text[: text.index(begin)] + text[text.index(end) + len(end) :]
    return text


def section(text: str, start: str, stop: str) -> str:
    return text.split(start, 1)[1].split(stop, 1)[0]


def test_the_block_counts_what_the_expected_states_table_says():
    pairs, table = figures.expected_states.load()
    block = the_block()
    assert f"Patches: {len(table)} in {len(figures.expected_states.groups())} groups." in block
    rows = {m[0]: tuple(map(int, m[1:])) for m in re.findall(r"^\| (\w+) \| (\d+) \| (\d+) \| (\d+) \|$", block, re.M)}
    want = {}
    for pair in pairs:
        codes = [row[pair] for row in table.values()]
        want[pair] = (codes.count("applied"), codes.count("fixed"), len(codes) - codes.count("applied") - codes.count("fixed"))
    assert rows == want


def test_the_block_has_every_pair_and_environment():
    pairs = list(figures.expected_states.pair_versions())
    block = the_block()
    assert re.findall(r"^\| (\w+) standins \+ interp \| \d+ \+ \d+ \|$", block, re.M) == pairs
    assert re.findall(r"^\| `\.matrix/(\w+)` \| [\d.]+ GB \|$", block, re.M) == ["base", *pairs, "ascendc"]
    assert re.search(r"^\| whole matrix .* \| \d+ \([\d.]+ min\) \|$", block, re.M)


def test_the_block_is_what_the_script_writes_from_a_log():
    """Regenerating from a log whose figures are read back from the README's own block gives that block."""
    block = the_block()
    pairs = list(figures.expected_states.pair_versions())
    cell = lambda name: re.search(rf"^\| {re.escape(name)} \| (\d+)", block, re.M).group(1)  # noqa: E731
    suites = {"unit": cell("unit"), "ascend compile": cell("ascend compile")}
    for pair in pairs:
        standins, interp = re.search(rf"^\| {pair} standins \+ interp \| (\d+) \+ (\d+)", block, re.M).groups()
        suites |= {f"{pair} standins": standins, f"{pair} interp": interp}
    disk = dict(re.findall(r"^\| `\.matrix/(\w+)` \| ([\d.]+) GB \|$", block, re.M))
    envs = re.search(r"^\| environments .*? \| (\d+) \|$", block, re.M).group(1)
    whole = re.search(r"^\| whole matrix .*? \| (\d+) ", block, re.M).group(1)
    log = [f"matrix: environments ready in {envs} s"]
    log += [f"=== {name}: exit 0 in {secs} s" for name, secs in suites.items()]
    log.append(f"matrix: {len(pairs)} pairs in {whole} s")
    log += [f"matrix: disk: {env} {size}G" for env, size in disk.items()]
    total = re.search(r"^\| `\.matrix/` in all \| ([\d.]+) GB \|$", block, re.M).group(1)
    date, cores = re.search(r"Measured (\S+) on a (\d+)-core", block).groups()
    bench = re.search(r"^\| `\.bench/` .* \| (\d+) KB \|$", block, re.M)
    bench = bench.group(1) + "K" if bench else "0"
    log.append(f"matrix: on disk: {total}G in /x/.matrix (all venvs), {bench} in .bench; {cores} cores, {date}")
    check_sh = re.search(r"^\| `scripts/check\.sh` on a clean clone .* \| (\d+) \|$", block, re.M)
    if check_sh:
        log.append(f"check.sh: exit 0 in {check_sh.group(1)} s")
    assert figures.block(figures.parse("\n".join(log))) == block


def test_a_failed_or_partial_log_gives_no_figures():
    with pytest.raises(ValueError, match="failed"):
        figures.parse("matrix: environments ready in 1 s\n=== unit: exit 1 in 8 s\n")
    with pytest.raises(ValueError, match="matrix: N pairs in N s"):
        figures.parse("matrix: environments ready in 1 s\n=== unit: exit 0 in 8 s\nmatrix: on disk: 1G in x (all venvs), 0 in .bench; 2 cores, 2026-12-05\n")


SIZE = re.compile(r"\b\d+(\.\d+)?\s?(GB|MB|KB)\b")
COUNT = re.compile(r"\b\d+\s+(patches|groups)\b|\b\d+ of \d+ patches")
DURATION = re.compile(r"\b\d+(\.\d+)?\s?(s|min|minutes?)\b|\b(one|two|three|four|five|ten|twenty)\s+minutes?\b")


def figures_in_prose(text: str) -> list[str]:
    """Sizes and patch counts anywhere in the prose; durations where the README talks about running
    the tools (quick start, the test suites, the matrix figures) -- elsewhere a figure like "10 s" is
    vllm-ascend's own timeout or a benchmark's result, not how long a stage takes."""
    body = prose(text)
    found = [m.group(0) for m in SIZE.finditer(body)] + [m.group(0) for m in COUNT.finditer(body)]
    for start, stop in (("## From a fresh machine", "## Installing"), ("## Tests", "The pool harness"), ("## Measured", "**Hot path**")):
        found += [m.group(0) for m in DURATION.finditer(section(body, start, stop))]
    return found


def test_the_prose_quotes_no_other_size_count_or_stage_time():
    assert figures_in_prose(README) == []


def test_the_prose_check_finds_a_stray_figure():
    """The check above can fail: the README's old figures, put back, are found."""
    stray = README.replace("(their size, and how long", "(6.2 GB; each pair 0.7-1 GB, about two minutes; their size, and how long")
    stray = stray.replace("`sys.modules` for unknown copies of each original;", "`sys.modules` for unknown copies of each original, now 31 patches;")
    assert figures_in_prose(stray) == ["6.2 GB", "1 GB", "31 patches", "two minutes"]
