"""``tools.bench_query``: the summary each rank's row reports."""

from __future__ import annotations

import pytest

from centralpipe.tools.bench_query import summary


def test_summary_is_mean_median_p90_and_max() -> None:
    samples = [float(x) for x in range(10, 0, -1)]  # unordered: 10 .. 1
    assert summary(samples) == (5.5, 5.5, 10.0, 10.0)
    assert summary([0.25]) == (0.25, 0.25, 0.25, 0.25)


def test_summary_of_no_samples_is_an_error() -> None:
    with pytest.raises(ValueError, match="no samples"):
        summary([])
