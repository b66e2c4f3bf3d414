import pytest

from contract.estimate import BOOTSTRAP, MIN_MAX, ONE_RUN, estimate, no_difference, ratio_interval, separated


def test_few_repetitions_give_their_min_max():
    e = estimate([1.2, 1.0, 1.1])
    assert (e.median, e.low, e.high, e.n, e.method) == (1.1, 1.0, 1.2, 3, MIN_MAX)
    assert e.plus_minus() == "±10 %"  # the larger side, rounded up
    assert estimate([1.0, 1.0]).plus_minus() == "±0 %"


def test_one_run_has_no_interval_and_never_separates():
    one = estimate([1.0])
    assert one.method == ONE_RUN and not one.has_interval and one.plus_minus() == "(1 run)"
    assert not separated(one, estimate([5.0, 5.1, 5.2]))
    assert no_difference(one, estimate([5.0, 5.1])) == "no claim: a single run has no interval"


def test_many_repetitions_give_a_bootstrap_interval_inside_their_range():
    values = [1.0, 1.01, 0.99, 1.02, 0.98, 1.0, 1.03, 0.97, 1.5]  # one outlier
    e = estimate(values)
    assert e.method == BOOTSTRAP and e.n == 9
    assert 0.97 <= e.low <= e.median <= e.high < 1.5  # the outlier does not widen the median's interval to it
    assert estimate(values) == e  # seeded: the same values, the same interval


def test_separated_only_where_the_intervals_do_not_overlap():
    a, b = estimate([1.0, 1.05, 1.1]), estimate([1.08, 1.12, 1.2])
    assert not separated(a, b)
    assert no_difference(a, b) == "no difference beyond noise (±8 %)"
    c = estimate([1.2, 1.25, 1.3])
    assert separated(a, c) and separated(c, a)
    ratio, low, high = ratio_interval(c, a)
    assert ratio == pytest.approx(1.25 / 1.05) and low == pytest.approx(1.2 / 1.1) and high == pytest.approx(1.3)


def test_no_values_is_an_error():
    with pytest.raises(ValueError):
        estimate([])
