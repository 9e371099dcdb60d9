"""Issue 36: every figure the README and docs/ give about the matrix -- time per stage, disk per
environment, patch counts -- sits in one block (docs/measured.md) that scripts/figures.py writes from
a matrix log; the block agrees with scripts/expected_states.txt and scripts/pairs.txt, and the prose
quotes no other such figure."""

from __future__ import annotations

import importlib.util
import re

import pytest

from support import ROOT, doc_files, doc_text

spec = importlib.util.spec_from_file_location("figures", ROOT / "scripts" / "figures.py")
figures = importlib.util.module_from_spec(spec)
spec.loader.exec_module(figures)
#: the pages whose prose is held to the block: the README and the docs/ pages that took its text;
#: not h200_postprocess.md (one kernel's own measurements, GB/s among them) nor
#: load-agreement-design.md (a design study, nothing about the matrix)
OWN_FIGURES = {"docs/h200_postprocess.md", "docs/load-agreement-design.md"}
TEXTS = {name: path.read_text() for path in doc_files() if (name := str(path.relative_to(ROOT))) not in OWN_FIGURES}
#: where a duration is about running the tools (the commands, the test suites, the matrix figures):
#: (page, from, to)
RUNNING = (
    ("README.md", "## From a fresh machine", "## Install"),
    ("docs/testing.md", "# Tests", "The pool harness"),
    ("docs/measured.md", "## Measured", "**Hot path**"),
)


def the_block(text: str | None = None) -> str:
    text = doc_text() if text is None else text
    assert text.count(figures.BEGIN) == 1 and text.count(figures.END) == 1
    return text[text.index(figures.BEGIN) : text.index(figures.END) + len(figures.END)]


def prose(text: str) -> str:
    """``text`` without the figures block and the two generated tables (those of them it holds)."""
    es = figures.expected_states
    for begin, end in ((figures.BEGIN, figures.END), (es.BEGIN, es.END), (es.GROUPS_BEGIN, es.GROUPS_END)):
        if begin in text:
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
    """Regenerating from a log whose figures are read back from the docs' own block gives that block."""
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
    log.append("matrix: all suites passed")
    assert figures.block(figures.parse("\n".join(log))) == block
    for bad in ("matrix: FAILED: smoke: bench_hotpath (exit 1)", "=== v0251 interp: FAILED: ran 0 tests (23 skipped), at least 1 expected"):
        with pytest.raises(ValueError, match="figures come from a passing run"):
            figures.parse("\n".join([*log, bad]))
    with pytest.raises(ValueError, match="no 'matrix: all suites passed' line"):
        figures.parse("\n".join(log[:-1]))


def test_readme_flag_rewrites_the_block_where_it_is(tmp_path, monkeypatch):
    """``--readme`` writes the block into the file that holds its markers (docs/measured.md)."""
    es = figures.expected_states
    assert es.holder(figures.BEGIN) == ROOT / "docs" / "measured.md"
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "measured.md"
    page.write_text(f"before\n{figures.BEGIN}\nold\n{figures.END}\nafter\n")
    (tmp_path / "README.md").write_text("# r\n")
    log = tmp_path / "matrix.log"
    log.write_text("\n".join([
        "matrix: environments ready in 1 s", "matrix: 1 pairs in 9 s", "matrix: disk: base 2.4G",
        "matrix: on disk: 2.4G in /x/.matrix (all venvs), 0 in .bench; 2 cores, 2026-12-07", "matrix: all suites passed",
    ]))
    monkeypatch.setattr(es, "ROOT", tmp_path)
    monkeypatch.setattr(figures, "block", lambda fig: f"{figures.BEGIN}\nnew {fig['date']}\n{figures.END}")
    assert figures.main([str(log), "--readme"]) == 0
    assert page.read_text() == f"before\n{figures.BEGIN}\nnew 2026-12-07\n{figures.END}\nafter\n"
    assert (tmp_path / "README.md").read_text() == "# r\n"


def test_a_failed_or_partial_log_gives_no_figures():
    with pytest.raises(ValueError, match="failed"):
        figures.parse("matrix: environments ready in 1 s\n=== unit: exit 1 in 8 s\n")
    with pytest.raises(ValueError, match="matrix: N pairs in N s"):
        figures.parse("matrix: environments ready in 1 s\n=== unit: exit 0 in 8 s\nmatrix: on disk: 1G in x (all venvs), 0 in .bench; 2 cores, 2026-12-05\n")


SIZE = re.compile(r"\b\d+(\.\d+)?\s?(GB|MB|KB)\b")
COUNT = re.compile(r"\b\d+\s+(patches|groups)\b|\b\d+ of \d+ patches")
DURATION = re.compile(r"\b\d+(\.\d+)?\s?(s|min|minutes?)\b|\b(one|two|three|four|five|ten|twenty)\s+minutes?\b")


def figures_in_prose(texts: dict[str, str]) -> list[str]:
    """Sizes and patch counts anywhere in the prose of ``texts`` (page: text); durations where a page
    talks about running the tools (:data:`RUNNING`) -- elsewhere a figure like "10 s" is vllm-ascend's
    own timeout or a benchmark's result, not how long a stage takes."""
    bodies = {name: prose(text) for name, text in texts.items()}
    body = "\n\n".join(bodies.values())
    found = [m.group(0) for m in SIZE.finditer(body)] + [m.group(0) for m in COUNT.finditer(body)]
    for page, start, stop in RUNNING:
        found += [m.group(0) for m in DURATION.finditer(section(bodies[page], start, stop))]
    return found


def test_the_prose_quotes_no_other_size_count_or_stage_time():
    assert figures_in_prose(TEXTS) == []


def test_the_prose_check_finds_a_stray_figure():
    """The check above can fail: the README's old figures, put back (in the README and in
    docs/measured.md), are found."""
    stray = dict(TEXTS)
    stray["README.md"] = stray["README.md"].replace(
        "(their size, and how long", "(6.2 GB; each pair 0.7-1 GB, about two minutes; their size, and how long")
    stray["docs/measured.md"] = stray["docs/measured.md"].replace(
        "`sys.modules` for unknown copies of each original;", "`sys.modules` for unknown copies of each original, now 31 patches;")
    assert figures_in_prose(stray) == ["6.2 GB", "1 GB", "31 patches", "two minutes"]
