from runners.cores import allowed_cores, machine_id, oversubscription, rank_cores


def _ranks(n, cores, machines=("m0",), threads=1):
    return [{"machine": machines[r % len(machines)], "cores": cores, "threads": threads} for r in range(n)]


def test_ranks_outnumbering_a_machines_cores_are_reported():
    assert oversubscription(_ranks(12, 2)) == {"threads": 12, "ranks": 12, "cores": 2, "machines": 1}
    assert oversubscription(_ranks(2, 2)) is None  # a core per rank
    assert oversubscription(_ranks(2, 2, threads=2)) == {"threads": 4, "ranks": 2, "cores": 2, "machines": 1}
    # four machines with a rank each: not crowded (a real cluster); by boot id, not host name
    assert oversubscription(_ranks(4, 2, machines=("a", "b", "c", "d"))) is None
    assert oversubscription([{"hostname": "h"}]) is None  # ranks that did not report: unknown, not claimed


def test_this_process_reports_its_machine_and_cores():
    me = rank_cores(1)
    assert me == {"machine": machine_id(), "cores": allowed_cores(), "threads": 1} and me["cores"] >= 1


def test_a_record_carries_it():
    from baselines.torch_pipe import SPEC
    from runners.record import build_record
    from tests.runners.test_records import _cfg, _rank

    ranks = [{**_rank(r, [1.0]), "machine": "m", "cores": 2, "threads": 1} for r in range(3)]
    assert build_record(_cfg(pp=3), SPEC, "ok", None, ranks, {}).oversubscribed == \
        {"threads": 3, "ranks": 3, "cores": 2, "machines": 1}
    assert build_record(_cfg(), SPEC, "ok", None, ranks[:2], {}).oversubscribed is None
