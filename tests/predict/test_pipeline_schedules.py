"""The zero-bubble schedules (torch_pipe's zb, zbv, dualpipev from torch's own orders; megatron's
predicted-only zb1p and zb2p, the paper's ZB-H1 and ZB-H2) and stages of unequal layer counts, in the
simulator and the memory model: the bubbles the paper states, no deadlock, the activations each keeps."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import ScheduleInterleavedZeroBubble

from baselines.torch_pipe import micro_batch_rule, stage_indices
from contract import ConfigError
from contract.config import stage_layer_counts
from contract.links import Link
from predict.pipeline_orders import Action, handcrafted, order, owner
from predict.programs import build
from predict.run_spec import Cluster, RunSpec
from predict.scenario import ScenarioError, parse, predict_scenario
from predict.simulator import Simulator
from predict.step_time import predict
from tests.predict.test_simulator import MODEL, Fixed
from workload.configs import get_model_config
from workload.memory import in_flight, rank_memory

FREE = Link(0.0, 1e15)
EVEN = Fixed(0.01, 0.02, wgrad=0.5)  # per layer T_F = T_B = T_W = 0.01 (the paper's analysis)


def run(system: str, schedule: str, pp: int, m: int, layers: int = 2, virtual_pp: int = 1, **kw) -> RunSpec:
    """pp stages of ``layers`` layers (per chunk) on one node of free links: no barrier frames the step."""
    n = kw.pop("n_layer", pp * virtual_pp * layers)
    return RunSpec(system, MODEL.with_overrides(n_layer=n), batch_size=m, micro_batch_size=1, link=FREE, pp=pp,
                   transport="nccl", schedule=schedule, virtual_pp=virtual_pp, cluster=Cluster(1, pp, FREE), **kw)


def peak_in_flight(actions: tuple[Action, ...]) -> int:
    """The most micro-batch chunks a rank's order holds activations of at once: forwards whose backward
    has not ended (a W ends it: the weight gradients need the linears' inputs, which the I keeps)."""
    held = peak = 0
    for a in actions:
        for c in a.sub or (a,):
            held += {"F": 1, "B": -1, "W": -1}.get(c.kind, 0)
            peak = max(peak, held)
    return peak


def bubble_share(spec: RunSpec) -> float:
    """The step beyond a rank's own work, as a share of that work (each rank's: M x its layers x 0.03)."""
    ideal = spec.n_micro_batches * spec.model.n_layer / spec.pp * 0.03
    return predict(spec, EVEN).step_time / ideal - 1


@pytest.mark.parametrize("pp, m", [(4, 8), (8, 16)])
def test_zero_bubble_bubbles_are_the_papers(pp, m):
    """At T_F = T_B = T_W: 1F1B (p - 1) / m, ZB-H1 a third of it, ZB-H2 none (its steady state)."""
    one_f_one_b = bubble_share(run("megatron", "1f1b", pp, m))
    zb1p = bubble_share(run("megatron", "zb1p", pp, m))
    zb2p = bubble_share(run("megatron", "zb2p", pp, m))
    assert one_f_one_b == pytest.approx((pp - 1) / m, abs=1e-6)
    assert zb1p == pytest.approx((pp - 1) / (3 * m), abs=1e-6)
    assert zb2p == pytest.approx(0.0, abs=1e-6)


def test_zbv_bubble_below_interleaved_1f1b():
    for pp, m in ((4, 8), (8, 16)):
        interleaved = bubble_share(run("torch_pipe", "interleaved", pp, m, virtual_pp=2))
        zbv = bubble_share(run("torch_pipe", "zbv", pp, m, virtual_pp=2))
        assert zbv < interleaved / 2, (pp, m, zbv, interleaved)


@pytest.mark.parametrize("schedule, virtual_pp", [("zb", 2), ("zbv", 2), ("dualpipev", 2), ("zb1p", 1), ("zb2p", 1)])
def test_orders_run_to_the_end(schedule, virtual_pp):
    """No deadlock (the simulator raises SimulationError on one) for P = 2..8 over micro-batch counts on
    both sides of P and 2P, each the schedule can run."""
    system = "megatron" if schedule.endswith("p") else "torch_pipe"
    for pp in range(2, 9):
        for m in sorted({1, pp - 1, pp, pp + 1, 2 * pp, 3 * pp + 1} - {0}):
            if system == "torch_pipe" and micro_batch_rule(schedule, pp, m):
                continue
            spec = run(system, schedule, pp, m, layers=1, virtual_pp=virtual_pp)
            built = build(spec, EVEN, steps=1)
            Simulator(built.programs, built.network).run()


def test_the_simulator_places_stages_as_torch_pipe_does():
    for schedule in ("1f1b", "interleaved", "zb", "zbv", "dualpipev"):
        for pp in (1, 2, 3, 4):
            for rank in range(pp):
                for stage in stage_indices(schedule, pp, rank, 2):
                    assert owner(schedule, pp, stage) == rank, (schedule, pp, stage)


def test_zb1p_is_torchs_zero_bubble_at_one_chunk_a_rank():
    """ZB-H1 as built here is the order torch's ScheduleInterleavedZeroBubble (its ZB1P) emits with one
    stage a rank."""
    for pp, m in ((2, 4), (4, 4), (4, 8), (4, 12), (8, 16)):
        stages = [SimpleNamespace(num_stages=pp, group_size=pp, group_rank=0, stage_index=0, submod=None)]
        torch_order = ScheduleInterleavedZeroBubble(stages, m, loss_fn=lambda out, tgt: out).pipeline_order
        for s in range(pp):
            theirs = [(a.computation_type.value, a.microbatch_index) for a in torch_order[s] if a is not None]
            assert handcrafted("zb1p", pp, s, m) == theirs, (pp, m, s)


def test_each_schedule_keeps_the_activations_its_order_holds():
    """workload.memory's in-flight micro-batches per schedule are the peaks of the orders the simulator
    runs (a micro-batch's activations live until its W): ZB-H1 P, ZB-H2 2P - 1 on every stage."""
    for schedule, virtual_pp in (("zb", 2), ("zb", 3), ("zbv", 2), ("dualpipev", 2), ("zb1p", 1), ("zb2p", 1)):
        for pp in (2, 3, 4, 6):
            for m in range(1, 3 * pp + 1):
                if schedule in ("zb", "zbv", "dualpipev") and micro_batch_rule(schedule, pp, m):
                    continue
                held = [peak_in_flight(actions) / virtual_pp for actions in order(schedule, pp, virtual_pp, m)]
                assert held == [in_flight("x", schedule, s, pp, m, virtual_pp) for s in range(pp)], (schedule, pp, m)
    assert in_flight("megatron", "zb2p", 0, 8, 32) == 2 * 8 - 1 and in_flight("megatron", "zb1p", 7, 8, 32) == 8


def test_zb2p_first_stage_holds_about_twice_1f1bs_activations():
    """Without an output layer the first stage is the fullest under each (its embeddings): ZB-H1 keeps
    1F1B's activations there, ZB-H2 (2P - 1) / P of them."""
    xl = get_model_config("gpt3-xl")
    common = dict(system="megatron", tp=1, pp=8, dp=1, micro_batch=1, n_micro=32, precision="bf16", recompute=False,
                  attention="flash", head=0)
    mem = {s: rank_memory(xl, schedule=s, **common) for s in ("1f1b", "zb1p", "zb2p")}
    assert {m.stage for m in mem.values()} == {0}
    assert mem["zb1p"].activations == mem["1f1b"].activations
    assert mem["zb2p"].activations / mem["1f1b"].activations == pytest.approx(2.0, rel=0.1)


# ---- stages of unequal layer counts ----------------------------------------------------------------------
def test_layers_per_stage_resolves_counts_and_ends():
    assert stage_layer_counts(24, 4) == (6, 6, 6, 6)
    assert stage_layer_counts(126, 16, "ends") == (7,) + (8,) * 14 + (7,)  # Llama 3 405B's
    assert stage_layer_counts(10, 3, (2, 5, 3)) == (2, 5, 3)
    for given, message in (((2, 5), "needs 3 counts"), ((2, 5, 2), "adding up to 10"), ((0, 5, 5), "1 layer or more"),
                           ("ends", "do not divide into 3 stages")):
        with pytest.raises(ConfigError, match=message):
            stage_layer_counts(10 if given != "ends" else 11, 3, given)


def test_unequal_stages_set_the_step_as_their_layers_say():
    """GPipe: every micro-batch through the stages, then (M - 1) more of the slowest stage's; 1F1B and
    ZB-H1: the stage with the most layers waits least and bounds the step; moving a layer off it
    shortens the step."""
    m = 6
    for counts in ((1, 3), (3, 1), (2, 2), (3, 4, 3), (4, 3, 3)):
        t = [n * 0.03 for n in counts]
        spec = run("torch_pipe", "gpipe", len(counts), m, n_layer=sum(counts), layers_per_stage=counts)
        assert predict(spec, Fixed(0.01, 0.02)).step_time == pytest.approx(sum(t) + (m - 1) * max(t), rel=1e-6)
    for system, schedule in (("megatron", "1f1b"), ("megatron", "zb1p")):
        steps = {}
        for counts in ((3, 4, 3), (4, 3, 3), (2, 3, 5)):
            spec = run(system, schedule, 3, m, n_layer=10, layers_per_stage=counts)
            built = build(spec, EVEN, steps=1)
            res = Simulator(built.programs, built.network).run()
            bubble = [res.window(r, "start0", "end0")[1].get("bubble", 0.0) for r in range(3)]
            assert min(range(3), key=bubble.__getitem__) == counts.index(max(counts)), (schedule, counts, bubble)
            steps[counts] = res.end_time
            assert res.end_time >= m * max(counts) * 0.03
        assert steps[(4, 3, 3)] < steps[(2, 3, 5)] and steps[(3, 4, 3)] < steps[(2, 3, 5)], steps


# ---- scenarios: GPT-3 XL on 2 x 8 H100 ---------------------------------------------------------------
def xl(system: str, schedule: str, **run_keys) -> dict:
    r = dict(dict(system=system, model="gpt3-xl", pp=4, dp=1, batch_size=8, micro_batch_size=1, precision="bf16",
                  schedule=schedule), **run_keys)
    return dict(run=r, cluster=dict(gpu="H100 SXM", nodes=2, gpus_per_node=8, inter_gbps=400, inter_delay_ms=0.005))


def test_gpt3_xl_on_h100_with_each_schedule():
    """Each schedule predicts a step; at P = 4, M = 8 the zero-bubble ones leave less bubble than 1F1B,
    ZB-H2 less than ZB-H1, ZB-V less than interleaved 1F1B; ZB-H2 keeps about twice the activations."""
    res = {}
    for system, schedule in (("megatron", "1f1b"), ("megatron", "zb1p"), ("megatron", "zb2p"),
                             ("torch_pipe", "interleaved"), ("torch_pipe", "zb"), ("torch_pipe", "zbv"),
                             ("torch_pipe", "dualpipev")):
        r = predict_scenario(parse(xl(system, schedule), f"{system}-{schedule}"))
        assert r["status"] == "ok" and r["step_time_s"] > 0, r
        assert sum(r["parts"].values()) == pytest.approx(r["step_time_s"], rel=1e-3)
        res[schedule] = r
    bubble = {s: r["parts"]["bubble"] for s, r in res.items()}
    assert bubble["zb2p"] < bubble["zb1p"] < bubble["1f1b"], bubble
    assert bubble["zbv"] < bubble["interleaved"] and bubble["zb"] < bubble["interleaved"], bubble
    assert res["zb2p"]["step_time_s"] < res["zb1p"]["step_time_s"] < res["1f1b"]["step_time_s"]
    assert res["zb2p"]["memory_gb"] > res["1f1b"]["memory_gb"] + 2


def test_unequal_stages_in_a_scenario_relieve_the_head_stage():
    """GPT-3 XL's last stage holds the head and the loss: one layer off it (and onto the stage before)
    shortens the step; 'ends' takes one layer off the first and the last stage."""
    equal = predict_scenario(parse(xl("megatron", "1f1b")))
    uneven = predict_scenario(parse(xl("megatron", "1f1b", layers_per_stage=[6, 6, 7, 5])))
    assert uneven["step_time_s"] < equal["step_time_s"] * 0.97
    ends = parse(xl("torch_pipe", "1f1b", num_layers=22, layers_per_stage="ends"))
    assert ends.config.options.stage_layers(ends.config) == (5, 6, 6, 5)
    assert predict_scenario(ends)["status"] == "ok"
    with pytest.raises(ScenarioError, match="adding up to 24 layers"):
        parse(xl("megatron", "1f1b", layers_per_stage=[6, 6, 6, 5]))


def test_zero_bubble_schedules_are_megatrons_in_a_scenario_and_refused_by_the_run_command():
    from runners.request import config_from_table

    sc = parse(xl("megatron", "zb2p"))
    assert sc.config.options.schedule == "zb2p"
    cfg, spec = config_from_table(xl("megatron", "zb1p")["run"])  # the registry's megatron, as --config reads it
    with pytest.raises(ConfigError, match="megatron: unknown --schedule 'zb1p'; choose from 1f1b, interleaved$"):
        spec.validate(cfg)
    with pytest.raises(ScenarioError, match="unknown --schedule 'zb1p'"):
        parse(xl("torch_pipe", "zb1p"))
