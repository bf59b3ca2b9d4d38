"""tests/check_skips.py, which .ci/run runs after pytest: a skip fails CI
unless tests/allowed_skips.txt allows its reason."""

from __future__ import annotations

import os

from tests import check_skips

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_answers" name="test_a"><skipped type="pytest.skip"
 message="needs POSIX signals">tests/test_answers.py:281: needs POSIX signals</skipped></testcase>
<testcase classname="" name="tests.test_mod"><skipped message="collection skipped">{module}</skipped></testcase>
<testcase classname="tests.test_b" name="test_xfail"><skipped type="pytest.xfail" message="known" /></testcase>
<testcase classname="tests.test_b" name="test_ok" />
</testsuite></testsuites>"""


def write(tmp_path, module_reason):
    """A report as pytest writes it, with a module-level skip (reason in a repr'd tuple)."""
    from xml.sax.saxutils import escape
    path = tmp_path / "junit.xml"
    path.write_text(REPORT.replace("{module}", escape(repr(("/x/tests/test_mod.py", 2,
                                                            "Skipped: " + module_reason)))))
    return str(path)


def test_allowed_skips_pass_and_others_fail(tmp_path, capsys):
    allowed = os.path.join(os.path.dirname(os.path.abspath(__file__)), "allowed_skips.txt")
    ok = write(tmp_path, "DP=2 / TP=2 on CPU bind one core per rank")
    assert check_skips.skips(ok)[1] == ("tests.test_mod", "DP=2 / TP=2 on CPU bind one core per rank")
    assert len(check_skips.skips(ok)) == 2  # the xfail is not a skip
    assert check_skips.main([ok, allowed]) == 0
    bad = write(tmp_path, "could not import 'scipy': No module named 'scipy'")
    assert check_skips.main([bad, allowed]) == 1
    assert "tests.test_mod: could not import 'scipy'" in capsys.readouterr().out
    assert check_skips.main([str(tmp_path / "missing.xml"), allowed]) == 0  # pytest's code says why


def test_every_allowed_reason_says_why():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "allowed_skips.txt")
    lines = open(path, encoding="utf-8").read().splitlines()
    entries = [i for i, line in enumerate(lines) if line.strip() and not line.startswith("#")]
    assert entries and len(check_skips.allow_list(path)) == len(entries)
    assert all(lines[i - 1].startswith("#") for i in entries)  # a comment right above each
