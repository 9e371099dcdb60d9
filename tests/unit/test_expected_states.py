"""scripts/expected_states.txt: one row per patch (in SPECS order), one column per pair, and the
README's table rendered from it."""

from __future__ import annotations

from support import ROOT, expected_states

from ascend_layerwise_patch.patches import SPECS


def test_every_patch_has_a_row_and_every_pair_a_column():
    es = expected_states()
    pairs, table = es.load()
    assert list(table) == [spec.name for spec in SPECS]
    assert pairs == list(es.pair_versions())


def test_the_readme_holds_the_rendered_table():
    es = expected_states()
    assert es.readme_block() in (ROOT / "README.md").read_text(), "run: python scripts/expected_states.py --readme"


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


def test_the_readme_holds_the_group_list_rendered_from_the_index():
    es = expected_states()
    assert [group for group, _package, _what in es.groups()] == list(dict.fromkeys(spec.group for spec in SPECS))
    assert es.groups_block() in (ROOT / "README.md").read_text(), "run: python scripts/expected_states.py --readme"
