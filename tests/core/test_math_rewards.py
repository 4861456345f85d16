"""The built-in verifiable rewards: gsm8k (final number, format variants), math (boxed answers; math-verify when
installed, the plain normaliser without it) and format (a regex)."""

import pytest

from hybridrl.plugins.discovery import get_registry
from hybridrl.rewards import math as m


@pytest.mark.parametrize("response, expected", [
    ("4 * 18 = 72\n#### 72", "72"),
    ("so #### 1,234", "1234"),
    ("#### $1,234.00", "1234.00"),
    ("#### -3", "-3"),
    ("first #### 5 then #### 6", "6"),
    ("The answer is 72.", "72"),
    ("answer: 18 apples", "18"),
    ("we get \\boxed{18} and 3", "18"),
    ("3 apples and 4 pears make 7", "7"),
    ("no number here", None),
])
def test_gsm8k_extraction_variants(response, expected):
    assert m.extract_gsm8k(response) == expected


def test_gsm8k_strict_wants_the_hashes():
    assert m.extract_gsm8k("the answer is 72") == "72"
    assert m.extract_gsm8k("the answer is 72", "strict") is None
    assert m.gsm8k_reward("", "the answer is 72", ground_truth="72", method="strict") == 0.0


@pytest.mark.parametrize("response, truth, score", [
    ("#### 72", "72", 1.0),
    ("#### 72.00", "72", 1.0),
    ("#### 1,234", "1234", 1.0),
    ("It costs $1,234.", "1,234", 1.0),
    ("#### 71", "72", 0.0),
    ("nothing", "72", 0.0),
    ("#### 72", "Ken gets 4 * 18 = 72.\n#### 72", 1.0),  # a TRL/raw GSM8K answer column: its #### is the reference
])
def test_gsm8k_scores(response, truth, score):
    assert m.gsm8k_reward("q", response, ground_truth=truth) == score


def test_gsm8k_format_score_and_bad_arguments():
    assert m.gsm8k_reward("", "#### 3", ground_truth="4", format_score=0.1) == 0.1
    with pytest.raises(ValueError, match="needs the row's reference answer"):
        m.gsm8k_reward("", "#### 3")
    with pytest.raises(ValueError, match="method must be flexible or strict"):
        m.gsm8k_reward("", "#### 3", ground_truth="3", method="loose")


@pytest.mark.parametrize("text, boxed", [
    ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("\\boxed{1} then \\boxed{\\sqrt{2}}", "\\sqrt{2}"),
    ("\\fbox{x^{2}}", "x^{2}"),
    ("$\\boxed 5$", "5"),
    ("\\boxed{unclosed", None),
    ("no box", None),
])
def test_last_boxed(text, boxed):
    assert m.last_boxed(text) == boxed


@pytest.mark.parametrize("answer, reference", [
    ("\\dfrac{1}{2}", "\\frac12"),
    ("1/2", "\\frac{1}{2}"),
    ("0.5", "\\frac{1}{2}"),
    ("5 \\text{ cm}", "5"),
    ("90^\\circ", "90"),
    ("x = 3", "3"),
    ("\\left(1, 2\\right)", "(1,2)"),
    ("2\\sqrt3", "2\\sqrt{3}"),
    ("10\\%", "10"),
])
def test_the_normaliser_accepts_format_variants(answer, reference):
    assert m.normalised_equal(answer, reference)


def test_the_normaliser_rejects_different_answers():
    assert not m.normalised_equal("\\frac{1}{3}", "\\frac{1}{2}")
    assert not m.normalised_equal("x^2+2x", "2x+x^2")  # symbolic equality needs math-verify


def test_math_reward_with_the_normaliser():
    kw = {"verifier": "normaliser"}
    assert m.math_reward("", "thus \\boxed{\\dfrac{7}{8}}", ground_truth="\\frac{7}{8}", **kw) == 1.0
    assert m.math_reward("", "thus \\boxed{\\frac{7}{9}}", ground_truth="\\frac{7}{8}", **kw) == 0.0
    assert m.math_reward("", "7/8 without a box", ground_truth="\\frac{7}{8}", **kw) == 0.0
    # a TRL solution column: its last boxed answer is the reference
    assert m.math_reward("", "\\boxed{2\\sqrt{3}}", ground_truth="The answer is $\\boxed{2\\sqrt{3}}$.", **kw) == 1.0
    assert m.math_reward("", "\\boxed{x^2+2x}", ground_truth="2x+x^2", **kw) == 0.0


needs_math_verify = pytest.mark.skipif(not m.math_verify_available(),
                                       reason="math-verify is not installed (pip install 'hybridrl[math]')")


@needs_math_verify
def test_math_reward_with_math_verify_accepts_symbolic_equality():
    for verifier in ("math_verify", "auto"):
        assert m.math_reward("", "\\boxed{x^2+2x}", ground_truth="2x+x^2", verifier=verifier) == 1.0
        assert m.math_reward("", "\\boxed{\\frac{2}{4}}", ground_truth="0.5", verifier=verifier) == 1.0
        assert m.math_reward("", "\\boxed{3}", ground_truth="4", verifier=verifier) == 0.0


def test_math_reward_without_math_verify(monkeypatch):
    monkeypatch.setattr(m, "math_verify_available", lambda: False)
    assert m.math_reward("", "\\boxed{x^2+2x}", ground_truth="2x+x^2") == 0.0  # auto falls back to the normaliser
    assert m.math_reward("", "\\boxed{\\dfrac{1}{2}}", ground_truth="0.5") == 1.0
    with pytest.raises(ValueError, match="needs the math-verify package"):
        m.math_reward("", "\\boxed{1}", ground_truth="1", verifier="math_verify")


def test_format_reward_modes_and_flags():
    assert m.format_reward("", "think...\n#### 7", pattern=r"think.*####") == 1.0  # DOTALL by default
    assert m.format_reward("", "think...\n#### 7", pattern=r"think.*####", flags="") == 0.0
    assert m.format_reward("", "x #### 7", pattern=r"####", mode="match") == 0.0
    assert m.format_reward("", "#### 7", pattern=r"#### \d+", mode="fullmatch") == 1.0
    assert m.format_reward("", "ANSWER", pattern="answer", flags="i") == 1.0
    with pytest.raises(ValueError, match="needs args.pattern"):
        m.format_reward("", "x")
    with pytest.raises(ValueError, match="unknown regex flag"):
        m.format_reward("", "x", pattern="x", flags="q")


def test_built_ins_are_registered():
    registry = get_registry()
    assert {"gsm8k", "math", "format", "reverse"} <= set(registry.names("reward"))
    assert registry.get("reward", "gsm8k") is m.gsm8k_reward
