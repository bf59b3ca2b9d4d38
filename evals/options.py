"""Command-line pieces the evals share: argument sets, errors, ``--early-stop``
rules, trace sets and result files."""

from __future__ import annotations

import json
import os
import sys

from consensus_spec.sampling.options import parse_stop_rule, text_value
from consensus_spec.sampling.stopping import StopRule

from .traces import shared_path


class UsageError(Exception):
    """Bad command line: reported as one ``error:`` line, exit code 2."""


def parse_early_stop(values: list[str] | None) -> list:
    """``--early-stop`` values -> list of StopRule (None: off), each read by
    the library's one parser (:func:`~consensus_spec.sampling.options.parse_stop_rule`:
    off, on, KIND, KIND:VALUE, KIND:FIELD=VALUE,..., a margin)."""
    if values is None:
        return [None]
    if not values:  # bare flag
        return [StopRule()]
    out = []
    for v in values:
        try:
            out.append(parse_stop_rule(v))
        except ValueError as e:
            raise UsageError(f"--early-stop expects a stop rule: {e}") from None
    return list(dict.fromkeys(out))


def parse_options(pairs: list[str]) -> dict:
    """``--option KEY=VALUE`` pairs as a dict; values are JSON where they
    parse (``min_prob=0.3``, ``warmup=false``), else strings (``cost_model=off``)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--option expects KEY=VALUE, got {pair!r}")
        out[key] = text_value(value)
    return out


def add_option_arg(ap, help: str = "consensus drafter option, e.g. min_prob=0.3 (repeatable)") -> None:
    """``--option KEY=VALUE``, repeatable (:func:`parse_options` reads them)."""
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help=help)


def add_trace_args(ap, defaults: str = "the shared traces") -> None:
    """``--traces``, ``--limit``, ``--tokenizer`` and ``--skip-bad-lines``:
    the replays' trace sets."""
    ap.add_argument("--traces", nargs="+", help=f"trace files (default: {defaults})")
    ap.add_argument("--limit", type=int, help="first N problems of each set")
    ap.add_argument("--tokenizer", help="tokenizer.json (default: shared GPT-2)")
    add_skip_bad_arg(ap)


def add_skip_bad_arg(ap) -> None:
    """``--skip-bad-lines``: a trace line that is not a JSON object is skipped
    and counted, not an error (:class:`~evals.traces.TraceLines`)."""
    ap.add_argument("--skip-bad-lines", action="store_true",
                    help="skip trace lines that are not JSON objects (counted and reported) "
                         "instead of stopping at the first")


def trace_sets(traces: list[str] | None, defaults: tuple[str, ...]) -> list[tuple[str, str]]:
    """(set name, path) of each ``--traces`` file, else of the shared trace
    files ``defaults``; the name is the file's without ``.jsonl``."""
    paths = traces or [shared_path("traces", t) for t in defaults]
    return [(os.path.basename(p).removesuffix(".jsonl"), p) for p in paths]


def fail(error) -> int:
    """A command's error: one ``error:`` line on stderr, exit status 2."""
    print(f"error: {error}", file=sys.stderr)
    return 2


def write_json(path, payload, indent: int | None = 1, default=None) -> None:
    """``payload`` as JSON at ``path``, creating its folder."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=indent, default=default)


def write_jsonl(path, rows) -> None:
    """``rows`` as JSON lines at ``path``, creating its folder."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def write_results(out: str, payload: dict, table: str) -> None:
    """``out``.json (``payload``) and ``out``.md (``table``), creating the folder."""
    write_json(out + ".json", payload)
    with open(out + ".md", "w") as f:
        f.write(table + "\n")
    print(f"wrote {out}.json and {out}.md")
