"""Fail on skipped tests whose reason the allow-list does not allow.

    python tests/check_skips.py JUNIT_XML [ALLOW_LIST]

``.ci/run`` runs it after pytest (``--junitxml``).  Every skipped test (xfails
aside) must have a reason matched by a line of ``ALLOW_LIST`` (default
``tests/allowed_skips.txt``: one Python regular expression per line, searched
in the reason; blank lines and ``#`` comments ignored).  Prints the skips that
are not allowed and exits 1; exits 0 when all are allowed or pytest wrote no
report (pytest's own exit code covers that case).
"""

from __future__ import annotations

import ast
import os
import re
import sys
import xml.etree.ElementTree as ET

DEFAULT_ALLOW_LIST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "allowed_skips.txt")


def allow_list(path: str) -> list[re.Pattern]:
    patterns = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                patterns.append(re.compile(line))
            except re.error as e:
                raise SystemExit(f"{path}, line {lineno}: not a regular expression ({e}): {line!r}")
    return patterns


def skips(junit_path: str) -> list[tuple[str, str]]:
    """(test id, reason) of every skipped test in a pytest JUnit XML report."""
    out = []
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        for skipped in case.findall("skipped"):
            if skipped.get("type") == "pytest.xfail":
                continue
            test = "::".join(x for x in (case.get("classname"), case.get("name")) if x)
            out.append((test, _reason(skipped)))
    return out


def _reason(skipped) -> str:
    message, text = skipped.get("message") or "", (skipped.text or "").strip()
    if message == "collection skipped":  # a module-level skip: text is repr((path, line, reason))
        try:
            message = str(ast.literal_eval(text)[2])
        except (ValueError, SyntaxError, TypeError, IndexError):
            found = re.search(r"Skipped: (.*)['\"]\)$", text, re.S)
            message = found.group(1) if found else text
        message = message.removeprefix("Skipped: ")
    return message


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not 1 <= len(argv) <= 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    junit, allowed = argv[0], argv[1] if len(argv) > 1 else DEFAULT_ALLOW_LIST
    if not os.path.exists(junit) or os.path.getsize(junit) == 0:
        print(f"check_skips: no test report at {junit}: nothing to check")
        return 0
    patterns = allow_list(allowed)
    found = skips(junit)
    bad = [(t, r) for t, r in found if not any(p.search(r) for p in patterns)]
    if bad:
        print(f"\n{len(bad)} of {len(found)} skips have a reason {allowed} does not "
              "allow (fix the test, or add the reason there with why it is acceptable):")
        for test, reason in bad:
            print(f"  {test}: {reason}")
        return 1
    if found:
        print(f"check_skips: all {len(found)} skips allowed by {allowed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
