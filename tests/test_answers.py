"""Answer extraction and equivalence, including inputs that must not hang."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import math_verify  # noqa: F401 - declared dependency: a missing one fails, never skips
import pytest

from consensus_spec.voting import answers as A  # noqa: E402
from consensus_spec.voting.answers import answers_equal, canonicalize, extract_answer  # noqa: E402


def within(seconds: float, fn, *args):
    """Run fn in a daemon thread; fail (rather than hang the suite) past
    ``seconds`` of wall time, a hang guard far above the expected time.
    Returns the value and the thread's own CPU time: what the work cost,
    whatever else the machine is doing."""
    box: dict = {}

    def target():
        start = time.thread_time()
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e
        box["cpu_s"] = time.thread_time() - start

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} took longer than {seconds}s"
    if "error" in box:
        raise box["error"]
    return box["value"], box["cpu_s"]


# --------------------------------------------------------------------------
# Extraction
# --------------------------------------------------------------------------

EXTRACT_CASES = [
    # boxed / fbox, nested braces, last box wins, nested boxes
    (r"So $x = \boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
    (r"\boxed{\dfrac{\sqrt{3}}{2}}", r"\dfrac{\sqrt{3}}{2}"),
    (r"first \boxed{1} then \boxed{2}", "2"),
    (r"\boxed{\boxed{42}}", "42"),
    (r"\fbox{7}", "7"),
    (r"The answer is \boxed 5$.", "5"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)"),
    (r"\boxed{(-\infty, 2]}", r"(-\infty, 2]"),
    (r"\boxed{x^{2}+2x+1}", "x^{2}+2x+1"),
    (r"\boxed{ 12 }", "12"),
    (r"unbalanced \boxed{3 and then #### 9", "9"),
    (r"\boxed{}  The answer is 4", "4"),
    (r"\boxed{\text{(B)}}", r"\text{(B)}"),
    (r"$\boxed{10\%}$", r"10\%"),
    (r"\boxed{\$1,000}", r"\$1,000"),
    # GSM8K marker
    ("Natalia sold 48 clips.\n#### 72", "72"),
    ("#### 1,234", "1,234"),
    ("#### 5\n#### 6", "6"),
    ("####\n no value then 3", "3"),
    # "The answer is X" phrases
    ("The answer is 42.", "42"),
    ("The final answer is $3\\sqrt{2}$. I hope it is correct.", r"3\sqrt{2}"),
    ("Final Answer: The final answer is 7. I hope it is correct.", "7"),
    ("Answer: 3.5", "3.5"),
    ("answer is 3.5.", "3.5"),
    ("The answer is: **42**", "42"),
    (r"Therefore, the answer is \(\frac{3}{4}\).", r"\frac{3}{4}"),
    ("The answer is that she has 18 dollars left.", "18"),
    ("so the answer = -7", "-7"),
    ("The answer is\n12", "12"),
    ("the answer is 10 cm.", "10 cm"),
    ("the answer is 1,000,000.", "1,000,000"),
    ("The answer is 5 because 2+3=5.", "5"),
    ("The answer is 12 square units.", "12"),
    (r"The answer is \frac{1}{2} of the pie", r"\frac{1}{2}"),
    (r"The answer is \text{Monday}", r"\text{Monday}"),
    ("The answer is x = 5 for all x", "5"),
    # multiple choice (AQuA style)
    ("The answer is (B) 24", "B"),
    ("Answer: C", "C"),
    ("the correct option is D.", "D"),
    ("Therefore the answer is (c).", "C"),
    ("answer is E)", "E"),
    ("The answer is **A**.", "A"),
    ("The answer is A bit more than 5", "5"),  # an article, not choice A
    ("the best option is to factor 12", "12"),
    # last-number fallback
    ("blah 3 then 4.5 end.", "4.5"),
    ("It costs $1,250 in total", "1,250"),
    ("we get -3/4 at the end", "-3/4"),
    ("about 50% of them", "50%"),
    ("x = 12.", "12"),
    # nothing
    ("no answer here", None),
    ("", None),
    (None, None),
    ("   ", None),
]


@pytest.mark.parametrize("text,expected", EXTRACT_CASES)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_uses_only_the_tail_and_drops_a_cut_token():
    head = "The answer is 1. " + "word " * 10_000
    text = head + "so finally 77"
    assert len(text) > A.MAX_TEXT_CHARS
    assert extract_answer(text) == "77"
    # a 100k-digit number straddles the window: never report a truncated value
    assert extract_answer("The answer is " + "9" * 100_000) is None


# --------------------------------------------------------------------------
# Canonical keys (no sympy)
# --------------------------------------------------------------------------

SAME_KEY = [
    ("1/2", "0.5"), ("0.50", r"\frac{1}{2}"), (r"\dfrac12", r"\tfrac{1}{2}"), ("2/4", "1/2"),
    ("1,000", "1000"), (r"\$1,000", "1000"), ("1000 dollars", "1000"), ("10 cm", "10"),
    ("10cm", "10"), (r"10\text{ cm}", "10"), (r"90^\circ", "90"), (r"90^{\circ}", "90"),
    ("+5", "5"), ("-0", "0"), ("1.5e3", "1500"), (r"50\%", "50%"), ("50 percent", "50%"),
    (r"\text{(B)}", "B"), ("(b)", "B"), ("B)", "(B)"), (r"\left(1,2\right)", "(1, 2)"),
    (r"x \in [1,2]", r"x\in[1,2]"), (r"\pi r^2", r"\pi r^{2}".replace("{2}", "2")),
    ("5 apples", "5"), (r"1{,}000", "1000"), ("007", "7"), (r"-\frac{3}{4}", "-3/4"),
]


@pytest.mark.parametrize("a,b", SAME_KEY)
def test_same_canonical_key(a, b):
    assert canonicalize(a).key == canonicalize(b).key


@pytest.mark.parametrize("a,b", [
    ("2x", "2"), ("2xy", "2"), (r"\pi r", r"\pir"), ("B", "b"), ("1,2", "12"),
    ("0.333333", "1/3"), ("5h", "5"), ("(1,2)", "(2,1)"),
])
def test_different_canonical_key(a, b):
    assert canonicalize(a).key != canonicalize(b).key


def test_canonical_kinds():
    assert canonicalize("(C)").kind == "choice"
    assert canonicalize("3/7").kind == "exact"
    assert canonicalize("0.25").kind == "math"  # decimals keep math-verify's rounding
    assert canonicalize("0.25").math == "0.25"
    assert canonicalize("x" * 600).kind == "text"


# --------------------------------------------------------------------------
# Equivalence (math-verify in the worker process)
# --------------------------------------------------------------------------

EQUAL = [
    ("1/2", "0.5"), (r"\frac{1}{2}", r"\dfrac12"), (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt2}"),
    (r"\sqrt{12}", r"2\sqrt{3}"), ("0.333333", r"\frac13"), (r"50\%", "0.5"), (r"50\%", "50"),
    ("x=3", "3"), ("(x+1)^2", "x^2+2x+1"), (r"\sin^2 x+\cos^2 x", "1"), (r"\frac{x}{2}", "0.5x"),
    ("y=2x+1", "2x+1"), ("[1,2)", r"1\le x<2"), (r"\{1,2\}", r"\{2,1\}"), ("1.5e3", "1500"),
    ("10^{3}", "1000"), (r"2\pi", "6.283185"), (r"\left(3, \frac{\pi}{2}\right)", r"(3, \pi/2)"),
    (r"(-\infty, 2)", r"(-\infty,2)"), (r"\infty", r"\infty"), (r"\frac{3}{-4}", "-0.75"),
    ("2^{1/2}/2", r"\frac{\sqrt{2}}{2}"), (r"\$1,000", "1000.00"), ("B", "(B)"),
    (r"\begin{pmatrix}1\\2\end{pmatrix}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}"),
]

NOT_EQUAL = [
    ("2", "3"), ("0.33", r"\frac13"), (r"\pi", "3.14"), ("x+1", "y+1"), ("(1,2)", "(2,1)"),
    ("B", "b"), ("B", "C"), ("2", "2.0001"), (r"\sqrt{2}", "1.41"), ("x^2", "2x"),
    (r"[1,2]", "(1,2)"), ("1/2", "1/3"), (r"\frac{1}{2}", "B"), ("12", "1,2"),
    (r"90^\circ", r"\frac{\pi}{2}"),
]


@pytest.mark.parametrize("a,b", EQUAL)
def test_equal(a, b):
    assert answers_equal(a, b)
    assert answers_equal(b, a)


@pytest.mark.parametrize("a,b", NOT_EQUAL)
def test_not_equal(a, b):
    assert not answers_equal(a, b)
    assert not answers_equal(b, a)


def test_none_never_equal():
    assert not answers_equal(None, None)
    assert not answers_equal("1", None)


def test_extract_then_compare_end_to_end():
    gold = extract_answer("... #### 1,234")
    pred = extract_answer(r"Adding up we get $\boxed{1234}$ apples.")
    assert answers_equal(gold, pred)
    assert answers_equal(extract_answer("The answer is (B) 24"), "B")


def test_works_off_the_main_thread():
    (value, _) = within(60, answers_equal, r"\sqrt{8}", r"2\sqrt{2}")
    assert value is True


# --------------------------------------------------------------------------
# Malformed inputs: none may hang
# --------------------------------------------------------------------------


def _garbage(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    alphabet = "{}\\$()[]^_0123456789,./ abcxyz\n" + "\\boxed{" * 3 + "answer is "
    return "".join(rng.choice(alphabet) for _ in range(n))


@pytest.mark.parametrize("text", [
    "{" * 1_000_000,
    "\\boxed{" + "{" * 100_000 + "1" + "}" * 100_000 + "}",
    "\\boxed{" + "{" * 1_500 + "1" + "}" * 1_500 + "}",
    "\\" * 1_000_000,
    "$" * 1_000_000,
    "1," * 500_000,
    "answer is " * 100_000,
    ("9" * 100_000) + " ",
    " ".join(["1" * 50] * 20_000),
    "-" * 1_000_000 + "5",
    "a" * 1_000_000 + "!",
    "\\boxed{" * 150_000,
    "\\boxed{1" * 150_000,
    "The answer is " + "x " * 500_000,
    ("9" * 3_000 + "x") * 300,
], ids=lambda t: f"{t[:12]!r}x{len(t)}")
def test_pathological_extraction_is_fast(text):
    value, cpu_s = within(60, extract_answer, text)
    assert cpu_s < 5
    assert value is None or len(value) <= A.MAX_ANSWER_CHARS


def test_one_megabyte_of_garbage():
    text = _garbage(1_000_000)
    value, cpu_s = within(60, extract_answer, text)
    assert cpu_s < 5
    if value is not None:  # whatever it found must be comparable, within its timeout
        within(120, answers_equal, value, "1")


def test_huge_numbers_compare_quickly_and_exactly():
    big = "9" * 4_000  # answers up to MAX_ANSWER_CHARS are kept verbatim
    text = f"The answer is {big}"
    assert extract_answer(text) == big
    too_long = "9" * (A.MAX_ANSWER_CHARS + 1)
    assert extract_answer(f"The answer is {too_long}") is None  # never cut short
    assert within(10, answers_equal, big, big)[0] is True
    assert within(10, answers_equal, big, big[:-1] + "8")[0] is False


@pytest.mark.parametrize("a,b", [
    ("10^{100000}", "10^{100000}+1"),
    ("10^{10^{10}}", "5"),
    ("9^{9^{9}}", "3"),
    ("10000000!", "5"),
    (r"\binom{10^{7}}{5000000}", "5"),
    ("{" * 200 + "1" + "}" * 200, "1"),
    (r"\frac{1}{0}", r"\frac{2}{0}"),
])
def test_expensive_math_is_bounded_by_timeout(a, b):
    # each would run for hours without the 1 s timeout (the worker is killed
    # GRACE_S after it); 60 s of wall time only guards against a hang
    value, _ = within(60, answers_equal, a, b, 1.0)
    assert value in (True, False)


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs POSIX signals")
def test_stuck_worker_is_killed_and_replaced():
    assert answers_equal("0.25", "1/4")  # make sure a worker is up
    engine = A.ENGINE
    old_pid = engine._proc.pid
    os.kill(old_pid, signal.SIGSTOP)  # freeze it: it can no longer answer
    start = time.monotonic()
    value, _ = within(60, answers_equal, r"\sqrt{9}", "3.0000", 0.5)
    assert value is False  # the stuck comparison counts as "not equal"
    assert time.monotonic() - start >= A.MathEngine.GRACE_S  # a lower bound: load only adds
    # a fresh worker answers (the stuck pair itself stays cached as unequal)
    assert answers_equal(r"\sqrt{16}", "4.0000")
    assert engine._proc.pid != old_pid


def test_without_worker_falls_back_to_canonical_strings():
    engine = A.MathEngine()
    engine._disabled = True  # as if the worker could not start
    assert engine.equal("0.5", r"\frac{1}{2}", 1.0) is False
    assert engine.equal("x", "x", 1.0) is True
    # canonical keys still merge exact forms without any worker
    assert canonicalize("0.5").key == canonicalize(r"\frac{1}{2}").key
