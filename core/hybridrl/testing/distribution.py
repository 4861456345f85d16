"""Is a rollout drawing from the distribution it claims? Frequencies of many draws of one next token against
the reference probabilities, by a chi-square test whose false-failure probability is fixed in advance.

Token-by-token checks (each token in the support, each log-prob equal to the reference's) cannot see an
engine that samples at one temperature and reports the log-probs of the requested one: every token is
possible under both, and every reported number is right. Only the frequencies show it.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import torch

#: a bin whose expected count is below this is pooled with the other small ones (the chi-square
#: approximation needs a handful of expected draws per bin).
MIN_EXPECTED = 5.0


def chi_square_critical(df: int, p_false: float) -> float:
    """The value a chi-square statistic with ``df`` degrees of freedom exceeds with probability ``p_false``
    (scipy's when installed, else the Wilson-Hilferty approximation, within a percent at these sizes)."""
    try:
        from scipy.stats import chi2
    except ImportError:
        z = NormalDist().inv_cdf(1.0 - p_false)
        c = 2.0 / (9.0 * df)
        return df * (1.0 - c + z * math.sqrt(c)) ** 3
    return float(chi2.isf(p_false, df))


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, list[int]]:
    """``(statistic, degrees of freedom, tokens drawn where probs is 0)`` of ``counts`` (V,) against ``probs``
    (V,), bins with fewer than ``MIN_EXPECTED`` expected draws pooled into one."""
    counts, probs = counts.double(), probs.double() / probs.sum()
    n = float(counts.sum())
    impossible = ((probs == 0) & (counts > 0)).nonzero().flatten().tolist()
    expected = probs * n
    big = expected >= MIN_EXPECTED
    observed = [*counts[big].tolist()]
    wanted = [*expected[big].tolist()]
    small = (~big) & (probs > 0)
    if small.any():
        observed.append(float(counts[small].sum()))
        wanted.append(float(expected[small].sum()))
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, wanted) if e > 0)
    return stat, max(len(wanted) - 1, 1), impossible


def describe(counts: torch.Tensor, probs: torch.Tensor, labels: list | None = None, top: int = 8) -> str:
    """The most expected bins: drawn share vs probability (what a failure shows)."""
    n = float(counts.sum())
    order = probs.argsort(descending=True)[:top].tolist()
    return ", ".join(f"{labels[t] if labels else t}: {float(counts[t]) / n:.3f} vs {float(probs[t]):.3f}"
                     for t in order)


def frequency_problems(counts: torch.Tensor, probs: torch.Tensor, p_false: float, what: str,
                       labels: list | None = None) -> list[str]:
    """Problems (none when the draws fit ``probs``; a correct engine fails with probability ``p_false``).
    ``labels``: a name per bin (default: the token id)."""
    stat, df, impossible = chi_square(counts, probs)
    problems = []
    if impossible:
        problems.append(f"tokens {impossible} were drawn {[int(counts[t]) for t in impossible]} times but have "
                        f"probability 0 under {what}")
    critical = chi_square_critical(df, p_false)
    if stat > critical:
        problems.append(f"{int(counts.sum())} draws against {what}: chi-square {stat:.1f} > {critical:.1f} "
                        f"({df} degrees of freedom, p < {p_false:g}); token: drawn share vs probability: "
                        f"{describe(counts, probs, labels)}")
    return problems


def noncentrality(p_true: torch.Tensor, p_claimed: torch.Tensor) -> float:
    """Per draw, how far the chi-square statistic grows when draws from ``p_true`` are tested against
    ``p_claimed`` (its expected value is ``df + n * this``): the kit sizes its draws with it."""
    p_true, p_claimed = p_true.double(), p_claimed.double()
    keep = p_claimed > 0
    return float(((p_true[keep] - p_claimed[keep]) ** 2 / p_claimed[keep]).sum())


def reported_problems(tokens: torch.Tensor, log_probs: torch.Tensor, p_false: float, atol: float) -> list[str]:
    """Are the reported log-probs those of the distribution the draws came from? ``tokens``/``log_probs``:
    (n,), one draw of the same next token per row. Rows that drew the same token must report the same
    log-prob, and the draws' frequencies must fit ``exp(reported)`` (the tokens never drawn share the rest):
    an engine that samples at one temperature and reports another's log-probs fails here."""
    problems = []
    reported: dict[int, float] = {}
    for token in tokens.unique().tolist():
        values = log_probs[tokens == token].double()
        spread = float(values.max() - values.min())
        if spread > atol:
            problems.append(f"token {token}: rows that drew it report log-probs from {float(values.min()):.6f} to "
                            f"{float(values.max()):.6f} (one next-token distribution, one log-prob per token)")
        reported[token] = float(values.mean())
    mass = sum(math.exp(v) for v in reported.values())
    if mass > 1.0 + max(atol, 1e-6) * len(reported):
        problems.append(f"the reported probabilities of the drawn tokens sum to {mass:.4f} > 1")
        return problems
    drawn = sorted(reported)
    counts = torch.tensor([float((tokens == t).sum()) for t in drawn] + [0.0])
    probs = torch.tensor([math.exp(reported[t]) for t in drawn] + [max(1.0 - mass, 0.0)])
    return problems + frequency_problems(counts, probs, p_false, "exp(rollout_log_probs)",
                                         [*drawn, "never drawn"])
