"""Answers read by a caller's regular expression, as eval harnesses read them.

lm-evaluation-harness scores GSM8K with ``regex_pattern: "The answer is
(\\-?[0-9\\.\\,]*[0-9]+)"`` and a ``group_select`` (0: the first match, -1:
the last).  :class:`AnswerPattern` reads a path's answer the same way, so
the voted answer is the one the harness's own regex reads from the voted
path.  Patterns come from clients: they run on the ``regex`` module under a
timeout (a pattern that backtracks without end gives no answer, it never
holds the server), on a bounded tail of the text, and are never evaluated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import regex

from .answers import MAX_ANSWER_CHARS, MAX_TEXT_CHARS

__all__ = ["AnswerPattern", "MAX_PATTERN_CHARS"]

MAX_PATTERN_CHARS = 1000
DEFAULT_PATTERN_TIMEOUT_S = 0.1  # per path: a sane pattern takes microseconds


@dataclass(frozen=True)
class AnswerPattern:
    """``pattern``: a regex; with groups, a match's first non-empty group is
    the answer (lm-eval's RegexFilter), without, the whole match.
    ``select``: which match, 0 the first, -1 the last (lm-eval's
    ``group_select``).  ``timeout_s``: the most one text's search may take
    (then the path has no answer).  Raises ValueError for a pattern that
    does not compile."""

    pattern: str
    select: int = 0
    timeout_s: float = DEFAULT_PATTERN_TIMEOUT_S
    _compiled: object = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ValueError("the answer pattern must be a non-empty string")
        if len(self.pattern) > MAX_PATTERN_CHARS:
            raise ValueError(f"the answer pattern has {len(self.pattern)} characters; "
                             f"at most {MAX_PATTERN_CHARS}")
        if isinstance(self.select, bool) or not isinstance(self.select, int):
            raise ValueError(f"select must be an int (0: first match, -1: last), got {self.select!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) \
                or not 0 < self.timeout_s <= 10:
            raise ValueError(f"timeout_s must be in (0, 10], got {self.timeout_s!r}")
        try:
            compiled = regex.compile(self.pattern)
        except (regex.error, RecursionError, OverflowError) as e:
            raise ValueError(f"the answer pattern does not compile: {e}") from None
        object.__setattr__(self, "_compiled", compiled)

    def __call__(self, text: str | None) -> str | None:
        if not text:
            return None
        try:
            found = self._compiled.findall(text[-MAX_TEXT_CHARS:], timeout=self.timeout_s)
        except TimeoutError:
            return None
        if not found:
            return None
        try:
            match = found[self.select]
        except IndexError:
            return None
        if isinstance(match, tuple):  # groups: the first that matched
            match = next((g for g in match if g), "")
        match = match.strip()
        return match[:MAX_ANSWER_CHARS] or None
