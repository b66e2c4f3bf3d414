"""ours.schedule: the order of a stage's forwards and backwards — complete, in dependency order,
free of deadlock across the stages of a pipeline, and (1f1b) holding at most P - s batch slices."""
from __future__ import annotations

import itertools

import pytest

from ours.schedule import SCHEDULES, ahead, leading_forwards, unit_order

SHAPES = [(P, nb, K) for P, nb, K in itertools.product((1, 2, 3, 4), (1, 2, 3, 5), (1, 2, 4))]


def run_pipeline(schedule: str, P: int, nb: int, K: int) -> list[tuple[int, str, int, int]]:
    """Run every stage's order against the pipeline's dependencies (a forward needs the previous
    stage's forward of the unit; a backward the next stage's backward of the unit, or on the last
    stage the batch slice's last forward; a stage runs its actions in its order); returns the actions
    in one order they could complete in. Fails if the stages deadlock."""
    orders = [unit_order(schedule, nb, K, s, P) for s in range(P)]
    done: set[tuple[int, str, int, int]] = set()
    pos = [0] * P
    out = []
    while any(pos[s] < len(orders[s]) for s in range(P)):
        progressed = False
        for s in range(P):
            if pos[s] == len(orders[s]):
                continue
            kind, b, i = orders[s][pos[s]]
            if kind == "F":
                ready = s == 0 or (s - 1, "F", b, i) in done
            else:
                ready = (s, "F", b, K - 1) in done and (s == P - 1 or (s + 1, "B", b, i) in done)
            if ready:
                done.add((s, kind, b, i))
                out.append((s, kind, b, i))
                pos[s] += 1
                progressed = True
        assert progressed, f"{schedule} deadlocks at P={P} nb={nb} K={K}: stages stuck at {pos}"
    return out


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("P,nb,K", SHAPES)
def test_every_unit_once_in_dependency_order(schedule, P, nb, K):
    for s in range(P):
        order = unit_order(schedule, nb, K, s, P)
        assert sorted(order) == sorted((k, b, i) for k in "FB" for b in range(nb) for i in range(K))
        at = {a: n for n, a in enumerate(order)}
        for b in range(nb):
            assert [at["F", b, i] for i in range(K)] == sorted(at["F", b, i] for i in range(K))  # token order
            assert [at["B", b, i] for i in reversed(range(K))] == sorted(at["B", b, i] for i in range(K))  # reverse
            assert at["F", b, K - 1] < at["B", b, K - 1]
    run_pipeline(schedule, P, nb, K)


@pytest.mark.parametrize("P,nb,K", SHAPES)
def test_1f1b_holds_at_most_P_minus_s_batch_slices(P, nb, K):
    for s in range(P):
        def held(schedule: str) -> int:
            live, peak = set(), 0
            for kind, b, i in unit_order(schedule, nb, K, s, P):
                if kind == "F":
                    live.add(b)
                    peak = max(peak, len(live))
                elif i == 0:
                    live.discard(b)
            return peak

        assert held("1f1b") == min(nb, P - s)
        assert held("gpipe") == nb


@pytest.mark.parametrize("P,K", [(2, 4), (3, 2)])
def test_one_batch_slice_is_the_same_in_both(P, K):
    for s in range(P):
        assert unit_order("1f1b", 1, K, s, P) == unit_order("gpipe", 1, K, s, P)


def test_the_last_stage_starts_a_batch_slice_backward_before_the_next_forward():
    assert unit_order("1f1b", 2, 2, 1, 2) == [("F", 0, 0), ("F", 0, 1), ("B", 0, 1), ("B", 0, 0),
                                              ("F", 1, 0), ("F", 1, 1), ("B", 1, 1), ("B", 1, 0)]
    assert unit_order("1f1b", 2, 1, 0, 2) == [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)]
    assert unit_order("gpipe", 2, 1, 1, 2) == [("F", 0, 0), ("F", 1, 0), ("B", 1, 0), ("B", 0, 0)]


def test_unknown_schedule():
    with pytest.raises(ValueError, match="unknown schedule"):
        unit_order("zb", 2, 2, 0, 2)


def test_the_default_is_1f1b_and_a_record_from_before_the_option_ran_gpipe():
    from ours import OursOptions

    assert OursOptions().schedule == "1f1b"
    assert OursOptions.from_dict({"n_slices": 4}).schedule == "gpipe"  # written before --schedule existed
    assert OursOptions.from_dict({"n_slices": 4, "schedule": "1f1b"}).schedule == "1f1b"


def run_two_steps(schedule: str, P: int, nb: int, K: int, ahead_counts: list[int]) -> None:
    """A step of every stage's order followed, on stage s, by the next step's first ``ahead_counts[s]``
    forwards, all before any stage begins the next step (the timing barrier between them): fails if a
    stage waits for something only the next step would run."""
    orders = [[(1, a) for a in unit_order(schedule, nb, K, s, P)]
              + [(2, a) for a in unit_order(schedule, nb, K, s, P)[:ahead_counts[s]]] for s in range(P)]
    done: set = set()
    pos = [0] * P
    while any(pos[s] < len(orders[s]) for s in range(P)):
        progressed = False
        for s in range(P):
            if pos[s] == len(orders[s]):
                continue
            step, (kind, b, i) = orders[s][pos[s]]
            if kind == "F":
                ready = s == 0 or (s - 1, step, "F", b, i) in done
            else:
                ready = (s, step, "F", b, K - 1) in done and (s == P - 1 or (s + 1, step, "B", b, i) in done)
            if ready:
                done.add((s, step, kind, b, i))
                pos[s] += 1
                progressed = True
        assert progressed, f"stages stuck at {pos} of {[len(o) for o in orders]}"


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("P,nb,K", SHAPES)
def test_what_a_stage_runs_ahead_needs_only_what_the_stages_before_it_ran_ahead(schedule, P, nb, K):
    """--prefetch N (ours.schedule.ahead): stage s runs N - s of the next step's forwards, at most those
    before its first backward, the last stage none; each stage's inputs for them were run ahead by the
    stage before in the same step, so a step and what runs ahead of the next never deadlock."""
    for n in sorted({0, 1, P - 1, P + 1, nb * K + P}):
        counts = [ahead(n, schedule, nb, K, s, P) for s in range(P)]
        assert counts[-1] == 0 and all(c <= max(0, n - s) for s, c in enumerate(counts))
        assert all(c <= leading_forwards(schedule, nb, K, s, P) for s, c in enumerate(counts))
        assert all(b <= a for a, b in zip(counts, counts[1:]))
        run_two_steps(schedule, P, nb, K, counts)


def test_a_stage_running_ahead_what_the_stage_before_did_not_deadlocks():
    """The check above can fail: stage 1 of 3 running a forward of the next step that stage 0 has not."""
    with pytest.raises(AssertionError, match="stuck"):
        run_two_steps("1f1b", 3, 1, 2, [0, 1, 0])


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("P,nb,K", SHAPES)
def test_what_runs_ahead_is_within_what_the_memory_model_holds_at_a_stages_peak(schedule, P, nb, K):
    """The forwards a stage can run ahead (those before its first backward) are the units of the batch
    slices ``workload.memory`` counts the stage holding at its peak: running them at the end of the step
    before (its gradients released) adds nothing to a rank's memory, so --prefetch auto is on wherever
    the run fits at all."""
    from workload.memory import in_flight

    for s in range(P):
        assert leading_forwards(schedule, nb, K, s, P) == in_flight("ours", schedule, s, P, nb) * K


def test_prefetch_is_auto_by_default_and_resolves_to_the_pipelines_skew():
    from ours import OursOptions, describe_run

    o = OursOptions()
    assert o.prefetch == "auto" and o.first_ahead(4) == 3 and o.first_ahead(1) == 0
    assert [ahead(o.first_ahead(4), "1f1b", 1, 4, s, 4) for s in range(4)] == [3, 2, 1, 0]
    assert [ahead(o.first_ahead(4), "1f1b", 1, 1, s, 4) for s in range(4)] == [1, 1, 1, 0]  # K = 1: one forward
    assert OursOptions.from_dict({"n_slices": 4, "schedule": "1f1b"}).prefetch == 0  # a record from before it
    assert OursOptions.from_dict({"n_slices": 4, "prefetch": "auto"}).prefetch == "auto"
    assert describe_run({"n_slices": 4, "slices": [8] * 4, "prefetch": 1}) == "K=4 (8x4), prefetch 1"
