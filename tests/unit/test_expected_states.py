"""scripts/expected_states.txt: one row per patch (in SPECS order), one column per pair, and the
table docs/patches.md renders from it (with the list of groups rendered from the index)."""

from __future__ import annotations

from support import ROOT, doc_text, expected_states

from ascend_layerwise_patch.patches import SPECS


def test_every_patch_has_a_row_and_every_pair_a_column():
    es = expected_states()
    pairs, table = es.load()
    assert list(table) == [spec.name for spec in SPECS]
    assert pairs == list(es.pair_versions())


def test_the_docs_hold_the_rendered_table():
    es = expected_states()
    assert es.holder(es.BEGIN) == ROOT / "docs" / "patches.md"
    assert es.readme_block() in doc_text(), "run: python scripts/expected_states.py --readme"


def test_a_bad_row_is_refused(tmp_path):
    bad = tmp_path / "t.txt"
    bad.write_text("patch v0251 v0260\nguard_wait applied maybe\n")
    try:
        expected_states().load(bad)
    except ValueError as exc:
        assert "bad row" in str(exc)
    else:
        raise AssertionError("a row with an unknown code was accepted")


def test_codes_from_check_reasons():
    code = expected_states().code_of
    assert code("applied", "") == "applied"
    assert code("skipped", "already fixed upstream: x") == "fixed"
    assert code("skipped", "version out of range: vllm 0.24.0 is outside") == "range"
    assert code("skipped", "ported: on these versions group g carries this fix (version out of range: x)") == "ported"
    assert code("skipped", "m does not import with the installed versions (e); nothing to patch") == "noimport"
    assert code("failed", "target changed: x") == "failed: target changed: x"


def test_the_docs_hold_the_group_list_rendered_from_the_index():
    es = expected_states()
    assert [group for group, _package, _what in es.groups()] == list(dict.fromkeys(spec.group for spec in SPECS))
    assert es.holder(es.GROUPS_BEGIN) == ROOT / "docs" / "patches.md"
    assert es.groups_block() in doc_text(), "run: python scripts/expected_states.py --readme"
    assert "](../ascend_layerwise_patch/patches/connector_guards/__init__.py)" in es.groups_block()  # links from docs/


def test_readme_rewrites_each_block_in_the_file_that_holds_it(tmp_path, monkeypatch):
    """``--readme`` finds each block's markers in README.md or docs/*.md and rewrites it there, with
    the group links relative to that file; markers in no file, or in two, are an error."""
    es = expected_states()
    (tmp_path / "docs").mkdir()
    readme, page = tmp_path / "README.md", tmp_path / "docs" / "page.md"
    readme.write_text(f"# r\n\n{es.GROUPS_BEGIN}\nold\n{es.GROUPS_END}\n")
    page.write_text(f"# p\n\n{es.BEGIN}\nold\n{es.END}\n\nafter\n")
    monkeypatch.setattr(es, "ROOT", tmp_path)
    assert es.main(["--readme"]) == 0
    assert page.read_text() == f"# p\n\n{es.readme_block()}\n\nafter\n"
    assert readme.read_text() == f"# r\n\n{es.groups_block()}\n"
    assert "](ascend_layerwise_patch/patches/connector_guards/__init__.py)" in readme.read_text()
    page.write_text(f"{es.GROUPS_BEGIN}\n{es.GROUPS_END}\n")
    try:
        es.holder(es.GROUPS_BEGIN)
    except ValueError as exc:
        assert "want exactly one file" in str(exc)
    else:
        raise AssertionError("markers in two files were accepted")
