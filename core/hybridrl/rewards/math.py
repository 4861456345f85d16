"""Verifiable math rewards: ``gsm8k`` (a final number) and ``math`` (a LaTeX answer in ``\\boxed{}``).

Both score 1.0 for a correct answer and ``format_score`` (default 0) for an answer that was found but is wrong,
0 when none was found; the reference is the row's ``ground_truth`` (``hybridrl.data.fields``), itself reduced
the same way (a GSM8K solution ending ``#### 72`` gives 72; a MATH solution its last boxed answer).

``math`` decides equivalence with ``math-verify`` (``pip install 'hybridrl[math]'``) when it is installed
(``verifier: auto``), else with a plain normaliser in the style of Hendrycks' MATH grader (spacing, ``\\dfrac``,
``\\left``/``\\right``, units in ``\\text{}``, degrees, ``\\frac12``, ``a/b``, equal numbers), which accepts fewer
equivalent forms: ``verifier: normaliser`` forces it, ``verifier: math_verify`` requires the package.
"""

from __future__ import annotations

import importlib.util
import math as _math
import re
from typing import Any

# --- GSM8K -----------------------------------------------------------------------------------------

_NUMBER = r"-?\$?\s*(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_HASHES = re.compile(r"####\s*(" + _NUMBER + ")")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*(" + _NUMBER + ")", re.IGNORECASE)
_ANY_NUMBER = re.compile(_NUMBER)


def _clean_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")


def extract_gsm8k(text: str, method: str = "flexible") -> str | None:
    """The final answer of a GSM8K-style response, as a plain number string (``1,234.`` -> ``1234``).

    ``strict``: only the last ``#### n``. ``flexible``: that, else the last ``\\boxed{n}``, else the last
    "answer is n", else the last number in the text."""
    found = _HASHES.findall(text)
    if found:
        return _clean_number(found[-1])
    if method == "strict":
        return None
    boxed = last_boxed(text)
    if boxed is not None:
        numbers = _ANY_NUMBER.findall(boxed)
        if numbers:
            return _clean_number(numbers[-1])
    for pattern in (_ANSWER_IS, _ANY_NUMBER):
        found = pattern.findall(text)
        if found:
            return _clean_number(found[-1])
    return None


def same_number(a: str, b: str) -> bool:
    try:
        x, y = float(a), float(b)
    except ValueError:
        return a == b
    return _math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9)


def gsm8k_reward(prompt: str, response: str, ground_truth: Any = None, method: str = "flexible",
                 format_score: float = 0.0, **_: Any) -> float:
    """1.0 when the response's final number equals the reference's; ``format_score`` when a number was found
    but is wrong. ``method``: ``flexible`` (default) or ``strict`` (only ``#### n`` counts)."""
    if method not in ("flexible", "strict"):
        raise ValueError(f"gsm8k: method must be flexible or strict, got {method!r}")
    if ground_truth is None:
        raise ValueError("gsm8k needs the row's reference answer (ground_truth; set data.answer_key)")
    truth = str(ground_truth)
    target = extract_gsm8k(truth, "strict") or _clean_number(truth.strip())
    got = extract_gsm8k(response, method)
    if got is None:
        return 0.0
    return 1.0 if same_number(got, target) else float(format_score)


gsm8k_reward.needs_ground_truth = True  # type: ignore[attr-defined]
gsm8k_reward.inline_safe = True  # type: ignore[attr-defined]  # fixed regexes, linear in the response


# --- MATH ------------------------------------------------------------------------------------------

def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed x``) in ``text``, braces
    balanced; None when there is none or it is not closed."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    if rest.startswith("\\boxed ") :
        return rest[len("\\boxed "):].split("$")[0].strip()
    brace = rest.find("{")
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(rest)):
        if rest[i] == "{":
            depth += 1
        elif rest[i] == "}":
            depth -= 1
            if depth == 0:
                return rest[brace + 1:i]
    return None


def _fix_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{2}`` -> ``\\frac{1}{2}``."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{") or len(part) < 2:
            out += part
            continue
        a, rest = part[0], part[1:]
        if rest.startswith("{"):
            out += "{" + a + "}" + rest
        else:
            out += "{" + a + "}{" + rest[0] + "}" + rest[1:]
    return out


def _fix_sqrt(s: str) -> str:
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


def normalize_answer(text: str) -> str:
    """A canonical string for a LaTeX answer: equal strings mean equal answers (the converse does not hold)."""
    s = str(text).strip()
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\circ", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = re.sub(r"\\text\{\s*[a-zA-Z ]*\}\s*$", "", s)  # a trailing unit: 5 \text{ cm}
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    if re.fullmatch(r"[a-zA-Z]\s*=.*", s):  # x = 5 -> 5
        s = s.split("=", 1)[1]
    s = _fix_sqrt(_fix_fracs(s.replace(" ", "")))
    match = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if match:
        s = f"\\frac{{{match.group(1)}}}{{{match.group(2)}}}"
    s = s.rstrip(".")
    if s.endswith(".0") and s[:-2].lstrip("-").isdigit():
        s = s[:-2]
    return s


def _as_number(s: str) -> float | None:
    match = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(\d+)\}", s)
    try:
        if match:
            value = int(match.group(2)) / int(match.group(3))
            return -value if match.group(1) else value
        return float(s.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def normalised_equal(answer: str, reference: str) -> bool:
    a, b = normalize_answer(answer), normalize_answer(reference)
    if a == b:
        return True
    x, y = _as_number(a), _as_number(b)
    return x is not None and y is not None and _math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9)


def math_verify_available() -> bool:
    return importlib.util.find_spec("math_verify") is not None


def math_verify_equal(answer: str, reference: str) -> bool:
    """Equivalence through ``math-verify`` (symbolic: ``0.5`` = ``\\frac{1}{2}``, ``x^2+2x`` = ``2x+x^2`` ...)."""
    from math_verify import parse, verify

    gold = parse(f"$\\boxed{{{reference}}}$")
    pred = parse(f"$\\boxed{{{answer}}}$")
    return bool(gold) and bool(pred) and bool(verify(gold, pred))


def _reference(ground_truth: Any) -> str:
    truth = str(ground_truth)
    boxed = last_boxed(truth)
    return boxed if boxed is not None else truth.strip()


def math_reward(prompt: str, response: str, ground_truth: Any = None, verifier: str = "auto",
                format_score: float = 0.0, **_: Any) -> float:
    """1.0 when the response's last ``\\boxed{}`` answer is equivalent to the reference; ``format_score`` when
    a boxed answer was found but is not. ``verifier``: ``auto`` | ``math_verify`` | ``normaliser``."""
    if verifier not in ("auto", "math_verify", "normaliser"):
        raise ValueError(f"math: verifier must be auto, math_verify or normaliser, got {verifier!r}")
    if ground_truth is None:
        raise ValueError("math needs the row's reference answer (ground_truth; set data.answer_key)")
    if verifier == "math_verify" and not math_verify_available():
        raise ValueError("math: verifier=math_verify needs the math-verify package: pip install 'hybridrl[math]'")
    answer = last_boxed(response)
    if answer is None:
        return 0.0
    reference = _reference(ground_truth)
    if normalised_equal(answer, reference):
        return 1.0
    use_verify = verifier == "math_verify" or (verifier == "auto" and math_verify_available())
    if use_verify and math_verify_equal(answer, reference):
        return 1.0
    return float(format_score)


def _warm_math() -> None:
    if math_verify_available():
        math_verify_equal("1", "1")  # imports sympy and the LaTeX parser (seconds) before the first timed call


math_reward.needs_ground_truth = True  # type: ignore[attr-defined]
math_reward.warmup = _warm_math  # type: ignore[attr-defined]


# --- format ----------------------------------------------------------------------------------------

_FLAGS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE}


def compile_pattern(pattern: str, flags: str = "s") -> re.Pattern[str]:
    bad = set(flags) - set(_FLAGS)
    if bad:
        raise ValueError(f"format: unknown regex flag(s) {''.join(sorted(bad))} (known: {''.join(_FLAGS)})")
    value = 0
    for flag in flags:
        value |= _FLAGS[flag]
    return re.compile(pattern, value)


def format_reward(prompt: str, response: str, pattern: str | None = None, mode: str = "search", flags: str = "s",
                  **_: Any) -> float:
    """1.0 when the response matches the regex ``pattern`` (``mode``: ``search`` anywhere, ``match`` at the
    start, ``fullmatch`` the whole response; ``flags``: letters of ``imsx``, DOTALL by default), else 0.0."""
    if pattern is None:
        raise ValueError("format needs args.pattern (a regular expression)")
    if mode not in ("search", "match", "fullmatch"):
        raise ValueError(f"format: mode must be search, match or fullmatch, got {mode!r}")
    regex = _compiled(pattern, flags)
    return 1.0 if getattr(regex, mode)(response) is not None else 0.0


_CACHE: dict[tuple[str, str], re.Pattern[str]] = {}


def _compiled(pattern: str, flags: str) -> re.Pattern[str]:
    key = (pattern, flags)
    if key not in _CACHE:
        _CACHE[key] = compile_pattern(pattern, flags)
    return _CACHE[key]
