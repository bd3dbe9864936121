"""tuning/timing.py's benchmark helpers that need no GPU: interleaved rounds and the median (spread) cell."""

from mstar_attn.tuning.timing import interleaved_rounds, median_spread


def test_rounds_interleave_the_calls_and_keep_each_rounds_median():
    order = []

    def timer(fn, n):
        order.append((fn(), n))
        return float(len(order))

    t = interleaved_rounds({"a": lambda: "a", "b": lambda: "b"}, rounds=3, n=7, timer=timer)
    assert order == [("a", 7), ("b", 7)] * 3  # round by round, never all of one arm first
    assert t == {"a": [1.0, 3.0, 5.0], "b": [2.0, 4.0, 6.0]}


def test_the_cell_is_the_median_and_its_range():
    assert median_spread([12.9, 12.1, 12.3]) == "12.3 (12.1-12.9)"
    assert median_spread([5.0, 7.0]) == "6.0 (5.0-7.0)"
