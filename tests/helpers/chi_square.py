"""Chi-square tests of sampled counts against exact laws (rows of probabilities, or a dict over sequences), and the
power of such a test against the hardest 1% bias."""
import torch
from scipy import stats


def chi_square_pvalue(counts, expected_probs, min_expected=5.0):
    """Pearson chi-square of count rows against probability rows (pooled); cells with too small an
    expectation are merged into one per row."""
    stat, dof = 0.0, 0
    for c, p in zip(counts, expected_probs):
        n = c.sum()
        if n == 0:
            continue
        e = n * p
        small = e < min_expected
        obs = torch.cat([c[~small], c[small].sum().reshape(1)]) if small.any() else c
        exp = torch.cat([e[~small], e[small].sum().reshape(1)]) if small.any() else e
        keep = exp > 0
        stat += float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
        dof += int(keep.sum()) - 1
    return stats.chi2.sf(stat, dof), dof


def rows_chi_square_pvalue(counts, probs):
    """One test over the rows of counts [R, V] against probs [R, V]: the sum of the rows' statistics, sum of (V - 1)
    degrees of freedom over the rows that have samples."""
    counts, probs = counts.double(), probs.double()
    n = counts.sum(-1, keepdim=True)
    used = n.squeeze(-1) > 0
    expected = n * probs
    assert (expected[used] >= 5).all(), "too few samples per cell for the chi-square approximation"
    stat = ((counts - expected) ** 2 / expected)[used].sum().item()
    return stats.chi2.sf(stat, int(used.sum()) * (probs.shape[-1] - 1))


def law_pvalue(counts: dict, law: dict) -> tuple[float, int]:
    """Chi-square p-value of the counts against the law (cells expected < 5 pooled) and its degrees of freedom;
    raises if a sequence of probability 0 was emitted."""
    n = sum(counts.values())
    impossible = {s: c for s, c in counts.items() if law.get(s, 0.0) == 0.0}
    assert not impossible, f"sequences of probability 0 emitted: {impossible}"
    expected = {s: p * n for s, p in law.items() if p > 0}
    big = [s for s, e in expected.items() if e >= 5]
    observed = [counts.get(s, 0) for s in big] + [sum(counts.get(s, 0) for s in expected if s not in big)]
    cells = [expected[s] for s in big] + [sum(e for s, e in expected.items() if s not in big)]
    if cells[-1] == 0:
        observed, cells = observed[:-1], cells[:-1]
    return float(stats.chisquare(observed, cells).pvalue), len(cells) - 1


def assert_law(counts: dict, law: dict) -> None:
    """Chi-square of the counts against the law (cells expected < 5 pooled), p > 1e-3, with the test's power
    against the hardest 1% bias at this many samples checked to be >= 0.9; no sequence of probability 0 emitted."""
    assert sum(counts[s] for s, p in law.items() if p == 0) == 0, "a sequence of probability 0 was emitted"
    samples = sum(counts.values())
    expected = {s: p * samples for s, p in law.items() if p > 0}
    big = [s for s, e in expected.items() if e >= 5]
    observed = [counts[s] for s in big] + [sum(counts[s] for s in expected if s not in big)]
    cells = [expected[s] for s in big] + [sum(e for s, e in expected.items() if s not in big)]
    if cells[-1] == 0:
        observed, cells = observed[:-1], cells[:-1]
    assert chi_square_power(law, samples, len(cells) - 1) >= 0.9
    assert stats.chisquare(observed, cells).pvalue > 1e-3


def chi_square_power(law: dict, n: int, df: int, alpha: float = 1e-3) -> float:
    """Power against the hardest 1% bias: 0.01 of probability mass moved between the two most likely
    sequences (the shift with the smallest noncentrality n * 0.01^2 * (1/p1 + 1/p2))."""
    p1, p2 = sorted(law.values())[-2:]
    noncentrality = n * 0.01 ** 2 * (1 / p1 + 1 / p2)
    critical = stats.chi2.ppf(1 - alpha, df)
    return float(stats.ncx2.sf(critical, df, noncentrality))


def bias_power(law: dict, n: int, df: int, bias: float) -> float:
    """chi_square_power (a 1% shift between the two likeliest sequences) scaled to a shift of `bias`: the
    noncentrality is n * bias^2 * (...), i.e. that of n * (bias / 0.01)^2 samples at 1%."""
    return chi_square_power(law, int(n * (bias / 0.01) ** 2), df)
