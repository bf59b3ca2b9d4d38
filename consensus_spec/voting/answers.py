"""Final-answer extraction and equivalence checking.

Extraction is pure regex/string work on a bounded tail of the text.
Canonical strings merge answers that are exactly equal for free; anything
else goes to math-verify, which runs in a killable helper subprocess (see
:mod:`consensus_spec.voting.equivalence`).  If the helper cannot run, equality falls
back to canonical strings.  Model output is never evaluated as Python.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from .equivalence import ENGINE, MathEngine  # noqa: F401  (re-exported for tests/tools)

MAX_TEXT_CHARS = 32_768  # answers sit at the end; bounds all regex work
MAX_ANSWER_CHARS = 4_096  # a longer "answer" is garbage, not an answer
MAX_MATH_CHARS = 512  # longer answers are compared as canonical strings only
MAX_NUMBER_DIGITS = 4_000  # below CPython's int<->str conversion limit
DEFAULT_TIMEOUT_S = 5.0

__all__ = [
    "Canonical",
    "answers_equal",
    "canonicalize",
    "equivalent",
    "extract_answer",
    "extract_final_answer",
    "normalize_answer",
]

# ---------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_GSM8K_RE = re.compile(r"####[ \t]*([^\n]*)")
_PHRASE_RE = re.compile(r"\banswer[ \t]*(?:is\b|:|=)[ \t*:]*\n?[ \t]*([^\n]+)", re.I)
_CHOICE_PHRASE_RE = re.compile(r"\b(?:option|choice)[ \t]+is[ \t:]*([^\n]+)", re.I)
_NUMBER_RE = re.compile(
    r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+)?%?"
)
# "(b)", "C)", "**D**", "\text{(E)}" at the start of an answer phrase.
_CHOICE_START_RE = re.compile(r"\(([A-Ja-j])\)|([A-J])(?:\)|[.,:;]|$)")
_SENTENCE_END_RE = re.compile(r"\.(?:\s|$)")
_WORD_RE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")  # not \commands


def extract_answer(text: str | None) -> str | None:
    """Return the final answer stated in ``text`` (lightly cleaned), or None.

    Priority: last ``\\boxed{}``/``\\fbox{}``, then GSM8K ``#### X``, then the
    last "answer is X" / "option is X" phrase, then the last number.  A
    multiple-choice answer comes back as its capital letter ("(b)" -> "B").
    A stated equation gives its result ("The answer is 2 x 2 = 4" -> "4");
    unevaluated arithmetic ("The answer is 60 x 3") is no answer.
    """
    return _extract(text, (_find_boxed, _find_gsm8k, _find_phrase, _find_last_number))


def extract_final_answer(text: str | None) -> str | None:
    """:func:`extract_answer` without the last-number fallback: only an
    answer the text states as final (boxed, ``####``, "the answer is").  A
    path cut off mid-reasoning, or one that never says its answer, gives
    None (it abstains) instead of whatever number it wrote last."""
    return _extract(text, (_find_boxed, _find_gsm8k, _find_phrase))


def _extract(text: str | None, finders) -> str | None:
    if not text:
        return None
    if len(text) > MAX_TEXT_CHARS:
        # Keep the tail, minus its first token, which may be cut mid-number.
        text = text[-MAX_TEXT_CHARS:]
        space = re.search(r"\s", text)
        if space is None:
            return None
        text = text[space.end() :]
    for find in finders:
        raw = find(text)
        if raw == UNDONE:
            return None  # the text states its answer, and it is no value
        if raw is not None:
            ans = _clean(raw)
            if ans:
                return ans
    return None


def _find_boxed(text: str) -> str | None:
    # Only the last few boxes can be the final answer; bounds the brace scans.
    for m in reversed(list(_BOX_RE.finditer(text))[-16:]):
        i = m.end()
        while i < len(text) and text[i] in " \t":
            i += 1
        if i < len(text) and text[i] == "{":
            content = _braced(text, i)
        else:  # "\boxed 5" form: one token
            content = re.match(r"[^\s$]*", text[i : i + MAX_ANSWER_CHARS]).group()
        if content and content.strip():
            return _unwrap_boxed(content.strip())
    return None


def _braced(text: str, start: int) -> str | None:
    """Content of the brace group opening at ``start``; None if unbalanced."""
    depth = 0
    end = min(len(text), start + MAX_ANSWER_CHARS)
    i = start
    while i < end:
        c = text[i]
        if c == "\\":
            i += 2  # skip escaped char, e.g. \{ or \}
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
        i += 1
    return None


def _unwrap_boxed(s: str) -> str:
    # \boxed{\boxed{5}} -> 5; bounded because s shrinks every round
    while True:
        m = _BOX_RE.match(s)
        if not m or s[m.end() : m.end() + 1] != "{":
            return s
        inner = _braced(s, m.end())
        if inner is None or m.end() + len(inner) + 2 != len(s):
            return s
        s = inner.strip()


def _find_gsm8k(text: str) -> str | None:
    last = None
    for m in _GSM8K_RE.finditer(text):
        if m.group(1).strip():
            last = m.group(1)
    return None if last is None else _stated_value(last.strip())


def _find_phrase(text: str) -> str | None:
    best = None
    for regex in (_PHRASE_RE, _CHOICE_PHRASE_RE):
        for m in regex.finditer(text):
            content = _phrase_content(m.group(1), choice_only=regex is _CHOICE_PHRASE_RE)
            if content is not None and (best is None or m.start() > best[0]):
                best = (m.start(), content)
    return best[1] if best else None


def _phrase_content(s: str, choice_only: bool) -> str | None:
    s = s.strip().strip("*").strip()
    probe = re.sub(r"^\\text(?:bf)?\{|^\$+|^\\\(", "", s).lstrip("*").lstrip()
    m = _CHOICE_START_RE.match(probe)
    if m:
        return (m.group(1) or m.group(2)).upper()
    if choice_only:
        return None
    end = _SENTENCE_END_RE.search(s)
    if end:
        s = s[: end.start()]
    s = _stated_value(s)
    if not s:
        return s
    # Prose after the answer ("5 because ...", "18 dollars left") or around
    # it ("that she has 18 apples"): keep the leading math, else the last
    # number.  One trailing word may be a unit ("10 cm") and is kept.
    words = list(_WORD_RE.finditer(s))
    if len(words) >= 2 or (words and re.search(r"[A-Za-z0-9]", s[words[0].end() :])):
        head = s[: words[0].start()].strip()
        if head and not head[0].isalpha():
            return head
        return _find_last_number(s)
    return s


_ARITHMETIC_RE = re.compile(
    r"[-+]?\$?\d[\d,]*(?:\.\d+)?(?:\s*(?:[x×*·÷+]|\s[-/]\s)\s*\$?\d[\d,]*(?:\.\d+)?)+")
_RESULT_RE = re.compile(r"\s*\$?\s*(-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?)"
                        r"(?![\d/^A-Za-z(\\{])(?!\s*[-+*/×^]\s*\d)")
UNDONE = ""  # a stated answer that is arithmetic left undone: no answer, and no fallback


def _stated_value(s: str) -> str | None:
    """An answer phrase's value: an equation's result ("2 x 2 = 4" -> "4"),
    ``UNDONE`` for arithmetic left undone ("60 x 3"), else the phrase itself.
    Equations whose right side is no plain number ("y = 2x + 1") stay whole."""
    if "=" in s and not re.search(r"[<>!]=|\\[lg]eq|\\neq", s):
        m = _RESULT_RE.match(s.rsplit("=", 1)[1])
        if m:
            return m.group(1)
        return s
    if _ARITHMETIC_RE.fullmatch(s.strip().rstrip(".")):
        return UNDONE
    return s


def _find_last_number(text: str) -> str | None:
    last = None
    for last in _NUMBER_RE.finditer(text):
        pass
    return last.group() if last else None


def _clean(s: str) -> str | None:
    s = s.strip()
    for _ in range(4):  # peel wrappers like "**$\(5\)$**."
        before = s
        s = s.strip().strip("*").strip().rstrip(".;,:").strip()
        if len(s) >= 2 and s[0] == "$" and s[-1] == "$" and not s.endswith("\\$"):
            s = s.strip("$")
        for a, b in (("\\(", "\\)"), ("\\[", "\\]")):
            if s.startswith(a) and s.endswith(b):
                s = s[2:-2]
        if s == before:
            break
    s = s.strip()
    if not s or len(s) > MAX_ANSWER_CHARS:
        return None
    return s


# ---------------------------------------------------------------------------
# Canonical strings (cheap; merge only forms that are exactly equal)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Canonical:
    """``key``: equal keys mean equal answers.  ``math``: text for math-verify
    (keeps decimals as written so its float tolerance still applies).  ``kind``:
    "choice" (a letter), "exact" (integer or fraction, key is its exact value),
    "math" (may need math-verify) or "text" (too long to risk; key only)."""

    key: str
    math: str
    kind: str


_CHOICE_RE = re.compile(r"\(?([A-J])\)?|\(([a-j])\)")
_WRAPPER_RE = re.compile(
    r"\\(?:text|textbf|textrm|mbox|mathrm|mathbf|operatorname)\{([^{}]*)\}"
)
_DROP_RE = re.compile(
    r"\\left(?![A-Za-z])|\\right(?![A-Za-z])|\\displaystyle|(?<!\\)\\[!,;: ]|~"
    r"|\^\{?\\circ\}?|°|\\\$|\$"
)
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DECIMAL_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,3})?")
_RATIO_RE = re.compile(r"([+-]?)(\d+)/(\d+)")
_FRAC_RE = re.compile(r"([+-]?)\\frac(?:\{([+-]?\d+)\}\{(\d+)\}|(\d)(\d))")
_LEADING_NUM_RE = re.compile(
    r"([+-]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)%?)\s*(.*)", re.S
)
_SCI_RE = re.compile(r"([+-]?\d+(?:\.\d+)?)[eE]([+-]?\d{1,3})")


def canonicalize(answer: str) -> Canonical:
    """Cheap canonical form of an extracted answer (no sympy)."""
    s = answer.strip()[:MAX_ANSWER_CHARS]
    s = _WRAPPER_RE.sub(r"\1", s).strip()
    m = _CHOICE_RE.fullmatch(s)
    if m:
        letter = (m.group(1) or m.group(2)).upper()
        return Canonical("choice:" + letter, letter, "choice")
    s = _DROP_RE.sub(" ", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("{,}", ",").replace("\\%", "%").strip()
    s = _strip_units(s)
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    number = _exact_number(s)
    if number is not None:
        exact = not re.search(r"[.eE]", s)  # integers and fractions: no rounding
        return Canonical(number, _SCI_RE.sub(r"\1\\times10^{\2}", s), "exact" if exact else "math")
    if s.endswith("%"):
        number = _exact_number(s[:-1].strip())
        if number is not None:
            return Canonical(number + "%", s, "math")
    # Whitespace is insignificant except where it ends a control word.
    key = re.sub(r"(\\[A-Za-z]+)\s+(?=[A-Za-z])", r"\1{}", s)
    key = re.sub(r"\s+", "", key)
    kind = "math" if 0 < len(s) <= MAX_MATH_CHARS else "text"
    return Canonical(key, s, kind)


def normalize_answer(answer: str) -> str:
    """Canonical key: equal keys are certainly equal answers."""
    return canonicalize(answer).key


_UNITS = frozenset(
    "m cm mm km g kg mg s sec secs min mins h hr hrs ml l ft in mi mph yd lb lbs "
    "oz inches feet meters miles hours minutes seconds days degrees dollars cents "
    "units".split()
)


def _strip_units(s: str) -> str:
    # "10 cm", "10cm", "5 apples" -> the number; "2x", "2xy" keep variables:
    # unknown words count as units only when set off by a space.
    m = _LEADING_NUM_RE.fullmatch(s)
    if not m or not m.group(2):
        return s
    unit = m.group(2).strip()
    spaced = s[m.end(1)].isspace()
    if unit.lower() == "percent" and spaced:
        return m.group(1) + "%"
    letters = unit.replace(" ", "")
    known = unit.lower() in _UNITS and (spaced or len(letters) >= 2)
    wordy = spaced and letters.isascii() and letters.isalpha() and len(letters) >= 2
    return m.group(1) if known or wordy else s


def _exact_number(s: str) -> str | None:
    """Exact rational as "p" or "p/q" for plain numerals; else None."""
    if len(s) > MAX_NUMBER_DIGITS:
        return None
    try:
        if _DECIMAL_RE.fullmatch(s):
            value = Fraction(s)
        elif m := _RATIO_RE.fullmatch(s):
            value = Fraction(int(m.group(2)), int(m.group(3)))
            value = -value if m.group(1) == "-" else value
        elif m := _FRAC_RE.fullmatch(s):
            num = int(m.group(2) or m.group(4))
            value = Fraction(num, int(m.group(3) or m.group(5)))
            value = -value if m.group(1) == "-" else value
        else:
            return None
    except (ValueError, ZeroDivisionError):  # int-str limit, 1/0
        return None
    return str(value)


# ---------------------------------------------------------------------------
# Equivalence
# ---------------------------------------------------------------------------


def cache_sizes() -> dict[str, list[int]]:
    """[entries held, bound] of the math-verify result caches (this process's)."""
    return ENGINE.cache_sizes()


def answers_equal(a: str | None, b: str | None, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """True if two extracted answers are mathematically the same.

    None never equals anything.  Each sympy step is limited to ``timeout_s``;
    a step that times out counts as "not equal".
    """
    if a is None or b is None:
        return False
    return equivalent(canonicalize(a), canonicalize(b), timeout_s)


def equivalent(a: Canonical, b: Canonical, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Equality of canonical forms: keys first, math-verify only if needed."""
    if a.key == b.key:
        return True
    kinds = {a.kind, b.kind}
    if kinds & {"choice", "text"} or kinds == {"exact"}:
        return False  # different letters / strings / exact rationals
    return ENGINE.equal(a.math, b.math, DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
