"""Today's options as a scenario writes them and the simulator runs them: megatron's sequence parallelism,
selective recompute, distributed optimizer and overlapped data parallelism, TransformerEngine's TP
overlap, fp8 GEMMs, a network card per GPU; the MLP's width and the llama family in every program."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest

from predict.programs import _fsdp_sizes, _grad_order, _megatron_order, _MegatronDDP, _Step, build, network_of
from predict.scenario import ScenarioError, compute_of, load, memory_of, parse, predict_scenario, spec_of
from predict.simulator import Send
from predict.step_time import predict
from workload.compute import stage_params
from workload.configs import get_model_config

SCENARIOS = Path(__file__).resolve().parents[2] / "predict" / "scenarios"
# a small megatron run on two H100 nodes of 4 GPUs
BASE = dict(run=dict(system="megatron", model="gpt3-xl", num_layers=8, hidden_size=2048, num_heads=16, seq_length=2048,
                     vocab_size=32000, tp=2, pp=2, dp=2, batch_size=4, micro_batch_size=1, precision="bf16"),
            cluster=dict(gpu="H100 SXM", nodes=2, gpus_per_node=4, inter_gbps=100, inter_delay_ms=0.01))


def scenario(run=None, cluster=None, predict=None, **top) -> dict:
    d = copy.deepcopy(BASE)
    d["run"].update(run or {})
    d["cluster"].update(cluster or {})
    if predict:
        d["predict"] = predict
    return d


def detail(d: dict) -> dict:
    """The critical rank's time by kind (compute kinds, tp_comm, dp, ...) of a scenario."""
    sc = parse(d)
    return predict(spec_of(sc), compute_of(sc)).detail


def dp_sends(d: dict) -> tuple[set, float]:
    """(the collectives, bytes) of every data-parallel message of a scenario's step."""
    sc = parse(d)
    built = build(spec_of(sc), compute_of(sc), steps=1)
    ops, nbytes = set(), 0.0
    for program in built.programs:
        for op in program:  # a ring's messages: ((step, "ddp", stage, what, chunk, bucket), op, ...)
            if isinstance(op, Send) and isinstance(op.key[0], tuple) and op.key[0][1] == "ddp":
                ops.add(op.key[1])
                nbytes += op.nbytes
    return ops, nbytes


def test_sequence_parallelism_lowers_activation_memory_with_the_same_tp_bytes():
    plain, sp = scenario(), scenario(run=dict(sequence_parallel=True))
    m0, m1 = memory_of(parse(plain)), memory_of(parse(sp))
    assert m1.activations < m0.activations
    assert (m1.weights, m1.gradients, m1.optimizer) == (m0.weights, m0.gradients, m0.optimizer)
    d0, d1 = detail(plain), detail(sp)
    assert d1["tp_comm"] == pytest.approx(d0["tp_comm"])  # a reduce-scatter and an all-gather: an all-reduce's bytes
    assert d1["forward"] < d0["forward"] and d1["backward"] < d0["backward"]  # the norms' work over tp


def test_selective_recompute_costs_less_than_full_and_keeps_less_than_none():
    """Materialised attention (the V100-era kernels, where the s^2 activations are what selective
    recompute frees): selective runs only the attention core again and keeps less than no recompute;
    full runs every layer's forward again (and its TP all-reduces) and keeps only the layers' inputs."""
    runs = {gran: scenario(run=dict(recompute=gran is not None, **({"recompute_granularity": gran} if gran else {})),
                           predict=dict(attention="materialized")) for gran in (None, "selective", "full")}
    res = {g: predict_scenario(parse(d)) for g, d in runs.items()}
    step = {g: r["step_time_s"] for g, r in res.items()}
    act = {g: memory_of(parse(d)).activations for g, d in runs.items()}
    assert step[None] < step["selective"] < step["full"]
    assert act["full"] < act["selective"] < act[None]
    assert "recompute" in detail(runs["selective"]) and "recompute" not in detail(runs[None])


def test_the_distributed_optimizer_shards_its_state_and_replaces_the_all_reduce():
    plain, dist = scenario(), scenario(run=dict(distributed_optimizer=True))
    m0, m1 = memory_of(parse(plain)), memory_of(parse(dist))
    assert m1.optimizer == pytest.approx(m0.optimizer / 2) and m1.total < m0.total  # D-2: 1/2 of the fp32 state
    ops0, bytes0 = dp_sends(plain)
    ops1, bytes1 = dp_sends(dist)
    assert ops0 == {"allreduce"} and ops1 == {"reduce_scatter", "allgather"}
    assert bytes1 == pytest.approx(bytes0)  # a ring's reduce-scatter and all-gather move an all-reduce's bytes
    assert detail(dist)["optimizer"] == pytest.approx(detail(plain)["optimizer"] / 2, rel=0.05)


def test_overlap_grad_reduce_hides_the_dp_collectives_behind_the_backward():
    """T-2 D-4, a node of 2 GPUs per replica, one micro-batch: the buckets' collectives leave as the
    backward finishes them (the same bytes, a shorter step, less DP wait); the parameter all-gather
    behind the next forward shortens it again."""
    layout, slow = dict(pp=1, dp=4, batch_size=4, micro_batch_size=4), dict(nodes=4, gpus_per_node=2)
    runs = {k: scenario(run=dict(layout, distributed_optimizer=True, **extra), cluster=slow)
            for k, extra in (("plain", {}), ("grad", dict(overlap_grad_reduce=True)),
                             ("both", dict(overlap_grad_reduce=True, overlap_param_gather=True)))}
    res = {k: predict_scenario(parse(d)) for k, d in runs.items()}
    assert res["both"]["step_time_s"] < res["grad"]["step_time_s"] < res["plain"]["step_time_s"]
    assert res["both"]["parts"]["dp_sync"] < res["grad"]["parts"]["dp_sync"] < res["plain"]["parts"]["dp_sync"]
    assert {k: dp_sends(d)[1] for k, d in runs.items()} == pytest.approx({k: dp_sends(runs["plain"])[1] for k in runs})
    # buckets of up to 40M parameters (T-2): the output layer and final norm, each of the 8 layers of 25M, the
    # embeddings (tokens split, positions whole), in the order the backward finishes them
    sc = parse(runs["grad"])
    spec = spec_of(sc)
    st = _Step(spec, compute_of(sc), network_of(spec), 0)
    layer = stage_params(spec.model, 1, False, False, 2)
    assert _MegatronDDP(st, 0).buckets[0] == [(32000 * 2048 // 2 + 2 * 2048, 0)] + [(layer, u) for u in range(1, 9)] \
        + [(32000 * 2048 // 2 + 2048 * 2048, 9)]


def test_tp_comm_overlap_hides_tensor_parallel_time_up_to_the_gemms():
    sp = scenario(run=dict(sequence_parallel=True))
    over = scenario(run=dict(sequence_parallel=True, tp_comm_overlap=True))
    assert detail(over).get("tp_comm", 0.0) < detail(sp)["tp_comm"]
    slow = dict(intra_gbps=50)  # the collectives far longer than the GEMMs: only the GEMMs' time hidden
    t_sp, t_over = detail(scenario(run=dict(sequence_parallel=True), cluster=slow)), \
        detail(scenario(run=dict(sequence_parallel=True, tp_comm_overlap=True), cluster=slow))
    assert 0 < t_sp["tp_comm"] - t_over["tp_comm"] < t_sp["forward"] + t_sp["backward"]


def test_fp8_speeds_the_gemms_only():
    bf16, fp8 = scenario(), scenario(predict=dict(gemm_precision="fp8"))
    d0, d1 = detail(bf16), detail(fp8)
    assert d1["forward"] < d0["forward"] and d1["backward"] < d0["backward"]
    same = ("tp_comm", "optimizer", "embed", "head", "dp")  # on the same critical rank, whatever it is
    assert {k: d1.get(k, 0.0) for k in same} == pytest.approx({k: d0.get(k, 0.0) for k in same})
    assert memory_of(parse(fp8)) == memory_of(parse(bf16))
    assert predict_scenario(parse(fp8))["gemm_precision"] == "fp8"
    for bad, message in ((dict(cluster=dict(gpu="A100 SXM4 80GB")), "has no fp8 GEMMs"),
                         (dict(run=dict(precision="fp32")), "[run] precision is fp32"),
                         (dict(predict=dict(gemm_precision="int4")), "must be the run's precision")):
        d = scenario(**bad) if "predict" in bad else scenario(**bad, predict=dict(gemm_precision="fp8"))
        with pytest.raises(ScenarioError, match=message.replace("[", r"\[").replace("]", r"\]")):
            parse(d)


def test_a_network_card_per_gpu_speeds_collectives_across_nodes():
    """Two nodes of 8: megatron T-8 D-2 (each replica a node: the DP all-reduce's 8 rings cross between
    the nodes, through one shared card or one card each) and T-16 (the TP group spans both nodes: its
    ring over one card or eight)."""
    def run(nics: int, **layout) -> dict:
        d = scenario(run=dict(pp=1, batch_size=1, **layout),
                     cluster=dict(nodes=2, gpus_per_node=8, inter_gbps=100, nics_per_node=nics))
        return detail(d)
    one, rail = run(1, tp=8, dp=2), run(8, tp=8, dp=2)
    assert rail["dp"] < one["dp"] / 4
    assert run(8, tp=16, dp=1, num_heads=16)["tp_comm"] < run(1, tp=16, dp=1, num_heads=16)["tp_comm"] / 2  # + delays
    # torch_pipe D-16 (FSDP over 16 GPUs, 8 a node): one ring, several GPUs of a node on it: a channel a card
    fsdp = {nics: detail(scenario(run=dict(system="torch_pipe", tp=1, pp=1, dp=16, batch_size=1, num_layers=2),
                                  cluster=dict(nodes=2, gpus_per_node=8, inter_gbps=100, nics_per_node=nics)))
            for nics in (1, 8)}
    assert fsdp[8]["fsdp"] < fsdp[1]["fsdp"] / 4
    with pytest.raises(ScenarioError, match="must divide gpus_per_node"):
        parse(scenario(cluster=dict(nics_per_node=3)))


@pytest.mark.parametrize("model", ["gpt3-xl", "llama3-8b"])
@pytest.mark.parametrize("ffn", [None, 3 * 4096])
def test_every_programs_parameters_are_the_models_family_and_mlp(model, ffn):
    """FSDP's block and root sizes, ours' gradient order and megatron's buckets count the parameters
    ``workload`` counts, for both families and an MLP of its own width."""
    m = get_model_config(model).with_overrides(n_layer=4, ffn_hidden=ffn)
    for system, tp in (("torch_pipe", 1), ("megatron", 2), ("ours", 1)):
        d = scenario(run=dict(system=system, model=model, num_layers=4, hidden_size=m.n_embd, num_heads=m.n_head,
                              seq_length=512, vocab_size=32000, tp=tp, dp=1, **({"ffn_hidden": ffn} if ffn else {})))
        if system == "ours":
            d["run"]["n_slices"] = 1
        sc = parse(d)
        spec = spec_of(sc)
        st = _Step(spec, compute_of(sc), network_of(spec), 0)
        for s, (first, last) in enumerate(((True, False), (False, True))):
            n = stage_params(spec.model, 2, first, last, st.tp)
            if system == "torch_pipe":
                block, root = _fsdp_sizes(spec, first, last)
                assert 2 * block + root == 4 * n
            elif system == "megatron":
                assert sum(k for k, _ in _megatron_order(st, s)) == n
            else:
                assert sum(k for k, _ in _grad_order(st, first, last)) == n


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("llama3-*.toml")), ids=lambda p: p.stem)
def test_the_llama_scenarios_parse_and_predict(path):
    res = predict_scenario(load(path))
    assert res["status"] in ("ok", "oom") and res["memory_gb"] > 0
    assert (res["step_time_s"] is None) == (res["status"] == "oom")


def test_ours_on_the_llama_family_is_predicted_and_its_tp_judged_as_in_a_run():
    """ours' engine runs the family: a scenario of it predicts; T must divide the key/value heads, as the run
    command judges it."""
    d = copy.deepcopy(load(SCENARIOS / "llama3-8b-8xh100-torch_pipe.toml").source)
    d["run"] = dict(system="ours", model="llama3-8b", pp=4, batch_size=64, micro_batch_size=1, precision="bf16")
    res = predict_scenario(parse(d))
    assert res["status"] in ("ok", "oom") and res["memory_gb"] > 0
    d["run"].update(pp=1, tp=16, dp=1)
    with pytest.raises(ScenarioError, match="ours splits the key/value heads over --tp 16"):
        parse(d)
