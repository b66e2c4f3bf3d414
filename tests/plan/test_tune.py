"""--n-slices auto's search over K (ours.plan.tune), on step times given as functions of K."""
from ours.plan.tune import CANDIDATES, Tuning, candidates, descend, nearest


def _timer(costs: dict[int, float]):
    timed = []

    def time_k(k: int) -> float:
        timed.append(k)
        return costs[k]

    return time_k, timed


def test_the_search_walks_down_to_the_fastest_k_then_times_it_and_its_rival_once_more():
    costs = {1: 2.0, 2: 1.4, 4: 1.1, 8: 1.2, 16: 1.5}  # falls while slicing fills the pipeline, then rises
    for start in CANDIDATES:
        time_k, timed = _timer(costs)
        t = descend(start, time_k)
        assert t.k == 4 and t.start == start
        assert len(set(timed)) <= 4 and timed[-2:] == [8, 4]  # never all five; the rival (K=8), then K=4 again
        assert len(timed) == len(set(timed)) + 2
        assert t.times == {k: (costs[k],) * timed.count(k) for k in dict.fromkeys(timed)}


def test_the_start_stays_where_no_neighbour_is_faster():
    time_k, timed = _timer({1: 3.0, 2: 1.0, 4: 1.0, 8: 2.0, 16: 3.0})
    assert descend(4, time_k).k == 4 and timed == [4, 2, 8, 2, 4]  # a tie keeps the start


def test_a_noisy_step_that_stopped_the_descent_is_timed_again():
    """A T-2 search of the main job: one slow step of K=2 stopped the descent at K=4."""
    steps = {1: [0.73, 0.74], 2: [0.93, 0.80], 4: [0.90, 0.91], 8: [0.94, 0.95], 16: [1.35, 1.3]}
    time_k, timed = _timer({})
    t = descend(4, lambda k: (timed.append(k), steps[k].pop(0))[1])
    assert t.k == 1 and timed == [4, 2, 8, 2, 4, 1, 1]
    assert t.times == {4: (0.90, 0.91), 2: (0.93, 0.80), 8: (0.94,), 1: (0.73, 0.74)}


def test_candidates_and_the_start_near_the_planners_k():
    assert candidates(1024) == (1, 2, 4, 8, 16) and candidates(6) == (1, 2, 4)
    assert nearest(15, candidates(1024)) == 16 and nearest(3, candidates(1024)) == 4 and nearest(5, (1, 2, 4, 8)) == 4
    assert descend(1, _timer({1: 1.0})[0], (1,)).k == 1


def test_the_record_says_what_was_timed():
    t = Tuning(4, 8, {8: (1.02,), 4: (0.951, 0.93), 16: (1.3,)})
    assert t.describe() == "tuned: K=4 of K=8 1.02 s, K=4 0.951/0.93 s, K=16 1.3 s"
