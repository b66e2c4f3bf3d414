"""--n-slices auto's search over K (ours.plan.tune), on step times given as functions of K."""
from ours.plan.tune import CANDIDATES, Tuning, candidates, descend, nearest


def _timer(costs: dict[int, float]):
    timed = []

    def time_k(k: int) -> float:
        timed.append(k)
        return costs[k]

    return time_k, timed


def test_the_search_walks_down_to_the_fastest_k_timing_each_once():
    costs = {1: 2.0, 2: 1.4, 4: 1.1, 8: 1.2, 16: 1.5}  # falls while slicing fills the pipeline, then rises
    for start in CANDIDATES:
        time_k, timed = _timer(costs)
        t = descend(start, time_k)
        assert t.k == 4 and t.start == start
        assert len(timed) == len(set(timed)) <= 4  # never all five, never one twice
        assert t.times == {k: costs[k] for k in timed}


def test_the_start_stays_where_no_neighbour_is_faster():
    time_k, timed = _timer({1: 3.0, 2: 1.0, 4: 1.0, 8: 2.0, 16: 3.0})
    assert descend(4, time_k).k == 4 and sorted(timed) == [2, 4, 8]  # a tie keeps the start


def test_candidates_and_the_start_near_the_planners_k():
    assert candidates(1024) == (1, 2, 4, 8, 16) and candidates(6) == (1, 2, 4)
    assert nearest(15, candidates(1024)) == 16 and nearest(3, candidates(1024)) == 4 and nearest(5, (1, 2, 4, 8)) == 4
    assert descend(1, _timer({1: 1.0})[0], (1,)).k == 1


def test_the_record_says_what_was_timed():
    assert Tuning(4, 8, {8: 1.02, 4: 0.951, 16: 1.3}).describe() == "tuned: K=4 of K=8 1.02 s, K=4 0.951 s, K=16 1.3 s"
