"""The simulator on cases that can be checked by hand: closed forms of the schedules, links, handshakes,
shared cores, deferred work, the timing barrier, ours' data-parallel messages."""
from __future__ import annotations

import math

import pytest

from workload.compute import ComputeModel, Overheads
from predict.simulator import Compute, Defer, FillWait, Flush, Mark, Network, Recv, Send, Simulator, Wait
from predict.step_time import predict
from contract.links import Link
from predict.run_spec import RunSpec
from workload.configs import ModelConfig

MODEL = ModelConfig("toy", n_layer=6, n_embd=64, n_head=4, seq_len=128, vocab_size=128)
FAST = Link(0.0, 1e15)


class Fixed(ComputeModel):
    """Every layer takes f forward and b backward on a whole sequence (in proportion to the tokens of a
    slice, independent of its context); no head, embeddings or optimizer; wgrad: the share of b that is
    weight gradients."""

    def __init__(self, f: float, b: float, wgrad: float = 0.0, overheads: Overheads | None = None):
        self.f, self.b, self.w, self.o = f, b, wgrad, overheads if overheads is not None else Overheads()

    def layer_forward(self, b, l, c, tp=1):
        return self.f * b * l / MODEL.seq_len / tp

    def layer_backward_input(self, b, l, c, tp=1):
        return self.b * (1 - self.w) * b * l / MODEL.seq_len / tp

    def layer_wgrad(self, b, l, tp=1):
        return self.b * self.w * b * l / MODEL.seq_len / tp

    def head_forward(self, tokens, tp=1, width=None):
        return 0.0

    head_backward_input = head_wgrad = head_forward

    def embed(self, tokens):
        return 0.0

    def optimizer(self, params):
        return 0.0

    def overheads(self, system):
        return self.o


def spec(system="torch_pipe", pp=2, batch=4, link=FAST, transport="nccl", **kw) -> RunSpec:
    return RunSpec(system, MODEL.with_overrides(n_layer=pp), batch_size=batch, micro_batch_size=1, link=link, pp=pp,
                   transport=transport, **kw)


@pytest.mark.parametrize("pp,m", [(2, 4), (3, 5), (2, 1)])
def test_gpipe_without_network_is_m_plus_p_minus_1_slots(pp, m):
    t = predict(spec(pp=pp, batch=m), Fixed(0.01, 0.02)).step_time
    assert t == pytest.approx((m + pp - 1) * 0.03, rel=1e-6)


@pytest.mark.parametrize("d", [0.001, 0.01])
def test_gpipe_2_stages_with_latency_closed_form(d):
    """torch's GPipe posts each receive after the previous micro-batch, so every message of a phase
    pays its delay one after the other (one in flight): (m + 1)(f + b) + 2 m d, plus the closing
    barrier's d (one round at 2 ranks)."""
    m, f, b = 4, 0.01, 0.02
    t = predict(spec(batch=m, link=Link(d, 1e15)), Fixed(f, b)).step_time
    assert t == pytest.approx((m + 1) * (f + b) + 2 * m * d + d, rel=1e-6)


def test_1f1b_has_the_gpipe_bubble_without_network():
    for system, schedule in (("torch_pipe", "1f1b"), ("megatron", "1f1b")):
        t = predict(spec(system, batch=6, schedule=schedule), Fixed(0.01, 0.02)).step_time
        assert t == pytest.approx((6 + 2 - 1) * 0.03, rel=1e-6), system


def test_interleaved_shrinks_the_bubble():
    cm = Fixed(0.01, 0.02)
    four = MODEL.with_overrides(n_layer=4)
    plain = predict(RunSpec("megatron", four, 4, 1, FAST, pp=2, schedule="1f1b", transport="nccl"), cm)
    inter = predict(RunSpec("megatron", four, 4, 1, FAST, pp=2, schedule="interleaved", virtual_pp=2,
                            transport="nccl"), cm)
    # per stage 2 layers: 1F1B (m + p - 1) * 2 (f + b); interleaved halves the fill and drain
    assert plain.step_time == pytest.approx(5 * 0.06, rel=1e-6)
    assert inter.step_time == pytest.approx(4 * 0.06 + 0.03, rel=1e-6)


@pytest.mark.parametrize("pp,k", [(2, 4), (3, 8)])
def test_ours_slices_follow_terapipe_when_communication_is_free(pp, k):
    """K equal token slices over P stages: sum_i t_i + (P - 1) max_i t_i (no weight gradients to defer)."""
    s = spec("ours", pp=pp, batch=1, slices=(MODEL.seq_len // k,) * k)
    t = predict(s, Fixed(0.04, 0.08)).step_time
    per_slice = 0.12 / k
    assert t == pytest.approx(k * per_slice + (pp - 1) * per_slice, rel=1e-6)


def test_ours_deferred_weight_gradients_fill_the_wait():
    """With half of the backward deferred, the first stage runs its queued weight gradients while it
    waits for the next gradient: the step shrinks by the wgrad share of the drain."""
    k, s = 4, spec("ours", pp=2, batch=1, slices=(32,) * 4)
    full = predict(s, Fixed(0.04, 0.08, wgrad=0.0)).step_time
    deferred = predict(s, Fixed(0.04, 0.08, wgrad=0.5)).step_time
    per_slice, wgrad = 0.12 / k, 0.04 / k
    assert full == pytest.approx(k * per_slice + per_slice, rel=1e-6)
    assert deferred == pytest.approx(k * per_slice + per_slice - wgrad, rel=1e-6)


def _three_messages(link: Link, transport: str = "nccl") -> list[float]:
    keys = [("m", i) for i in range(3)]
    p0 = [Send(k, 1, 1000) for k in keys] + [Wait(tuple(keys))]
    p1 = [Recv(k, 0, 1000) for k in keys] + [x for k in keys for x in (Wait((k,)), Mark(str(k[1])))]
    res = Simulator([p0, p1], Network(link, transport)).run()
    return [res.marks[1][str(i)][0] for i in range(3)]


def test_one_message_in_flight_serialises_messages():
    d, wire = 0.01, 1000 / 1e6
    assert _three_messages(Link(d, 1e6, in_flight=1)) == pytest.approx([(i + 1) * (wire + d) for i in range(3)])
    assert _three_messages(Link(d, 1e6)) == pytest.approx([(i + 1) * wire + d for i in range(3)])


def test_gloo_waits_for_the_receive_posted_notice():
    """gloo sends the data only once the receiver's notice arrived: a receive posted at t costs t + 2 d."""
    d = 0.01
    p0 = [Send("x", 1, 8), Wait(("x",))]
    p1 = [Compute(0.1, "forward"), Recv("x", 0, 8), Wait(("x",)), Mark("got")]
    for transport, expect in (("gloo", 0.1 + 2 * d), ("nccl", 0.1 + d)):
        res = Simulator([p0, p1], Network(Link(d, 1e15), transport)).run()
        assert res.marks[1]["got"][0] == pytest.approx(expect), transport


def test_emulated_link_stall():
    d = 0.02
    link = Link(d, 1e15, stall_bytes=24576)
    assert link.transfer(1024) == pytest.approx(d + d * 1024 / 24576)
    assert link.transfer(65536) == pytest.approx(2 * d)
    assert Link(d, 1e6, stall_bytes=24576).transfer(1e6) == pytest.approx(1.0 + d)  # the wire dominates


def test_shared_cores_stretch_compute():
    progs = [[Compute(1.0, "forward"), Mark("end")] for _ in range(2)]
    one = Simulator(progs, Network(FAST), cores=1.0).run()
    two = Simulator(progs, Network(FAST), cores=2.0).run()
    assert one.marks[0]["end"][0] == pytest.approx(2.0) and two.marks[0]["end"][0] == pytest.approx(1.0)


def test_fill_wait_runs_deferred_chunks_while_waiting():
    p0 = [Defer((0.3, 0.3, 0.3)), Recv("g", 1, 8), FillWait("g"), Mark("got"), Flush(), Mark("end")]
    p1 = [Compute(0.5, "backward"), Send("g", 0, 8), Wait(("g",))]
    res = Simulator([p0, p1], Network(FAST, "nccl")).run()
    # two chunks start before the gradient arrives at 0.5 (the second finishes at 0.6), the third after
    assert res.marks[0]["got"][0] == pytest.approx(0.6)
    assert res.marks[0]["end"][0] == pytest.approx(0.9)


@pytest.mark.parametrize("transport", ["gloo", "nccl"])
@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_barrier_costs_one_delay_per_round(n, transport):
    """The timing barrier: ceil(log2 n) rounds of one message each; over gloo its receives are posted
    one use ahead, so no round waits for a receive-posted notice."""
    from predict.programs import _barrier, _barrier_receives

    d = 0.01
    net = Network(Link(d, 1e15), transport)
    world = tuple(range(n))
    step = Compute(0.1, "forward")  # the step between two uses (the posted receives' notices arrive)
    progs = [_barrier_receives(net, world, r, "a") + [step] + _barrier(net, world, r, "a", "b") + [Mark("a"), step]
             + _barrier(net, world, r, "b", None) + [Mark("b")] for r in world]
    res = Simulator(progs, net).run()
    rounds = math.ceil(math.log2(n))
    for r in world:
        assert res.marks[r]["a"][0] == pytest.approx(0.1 + rounds * d, rel=1e-6)
        assert res.marks[r]["b"][0] == pytest.approx(0.2 + 2 * rounds * d, rel=1e-6)


def _ours_dp(dp: int, mode: str, link: Link, transport: str, wgrad: float = 0.0, model=MODEL):
    """(spec, the longest DP sync of any rank in the timed step) of ours at P = 1."""
    from predict.programs import build

    s = RunSpec("ours", model.with_overrides(n_layer=1), batch_size=1, micro_batch_size=1, link=link, pp=1,
                transport=transport, dp=dp, dp_mode=mode)
    built = build(s, Fixed(0.01, 0.02, wgrad=wgrad))
    res = Simulator(built.programs, built.network).run()
    return s, max(res.window(r, "start1", "end1")[1].get("dp", 0.0) for r in range(dp))


def _buckets_of(s: RunSpec) -> list[tuple[int, int]]:
    """(bytes, the deferred linear that completes it) of each bucket of the stage."""
    from predict.programs import _buckets, _grad_order, _Step, network_of

    st = _Step(s, Fixed(0.01, 0.02), network_of(s), 0)
    return [(n * 4, at) for n, at in _buckets(_grad_order(st, True, True))]


@pytest.mark.parametrize("transport", ["gloo", "nccl"])
@pytest.mark.parametrize("dp,mode", [(2, "central_ps"), (4, "central_ps"), (3, "sharded_ps"), (4, "sharded_ps"),
                                     (2, "allreduce"), (4, "allreduce")])
def test_ours_dp_is_one_round_point_to_point(dp, mode, transport):
    """One bucket of S bytes (the toy stage), receives posted a step ahead (no handshake over gloo):
    the replicas push at once, each over its own link (the simulator shares a host's egress, not its
    ingress), and the reducing ranks send back over theirs. central PS: the push S/B + d, then the
    server's D - 1 pulls one after the other, (D - 1) S/B + d; sharded PS (and all-reduce at D > 2):
    every rank sends D - 1 ranges of S/D each way; all-reduce at D = 2: one exchange, S/B + d."""
    d, B = 0.005, 1e8
    s, sync = _ours_dp(dp, mode, Link(d, B), transport)
    ((S, _),) = _buckets_of(s)
    if mode == "central_ps":
        expect = 2 * d + S / B + (dp - 1) * S / B
    elif mode == "allreduce" and dp == 2:
        expect = d + S / B
    else:
        share = -(-S // 4 // dp) * 4  # each range, in whole fp32 elements
        expect = 2 * d + 2 * (dp - 1) * share / B
    if transport == "nccl":
        assert sync == pytest.approx(expect, rel=1e-3)
    else:  # ranks enter the timed step as the barrier's messages left them (a few wire times apart)
        assert expect * (1 - 1e-3) < sync < expect + d / 2  # a receive-posted handshake would add d


@pytest.mark.parametrize("dp", [2, 4])
def test_the_seeds_chain_ps_is_a_chain_reduce_and_broadcast_per_bucket(dp):
    """The seed's central PS over NCCL (``chain_ps``), one bucket of S bytes (the toy stage, no optimizer
    time): a chain reduce and a chain broadcast, each (D - 1) d + S/B; no point-to-point star."""
    d, B = 0.005, 1e8
    s, sync = _ours_dp(dp, "chain_ps", Link(d, B), "nccl")
    ((S, _),) = _buckets_of(s)
    assert sync == pytest.approx(2 * ((dp - 1) * d + S / B), rel=1e-3)


def test_ours_pushes_buckets_while_weight_gradients_run():
    """A stage of several buckets whose weight gradients take long: each bucket leaves as its last
    linear's gradient is final, so the sync waits only for the buckets the last linear completes (the
    output layer's gradient costs nothing here): their bytes and one delay (all-reduce at D = 2)."""
    d, B = 0.005, 1e9
    model = MODEL.with_overrides(n_embd=512, n_head=8)
    s, none = _ours_dp(2, "allreduce", Link(d, B), "nccl", wgrad=0.0, model=model)
    _, slow = _ours_dp(2, "allreduce", Link(d, B), "nccl", wgrad=0.9, model=model)
    buckets = _buckets_of(s)
    tail = sum(b for b, at in buckets if at >= 3)  # completed by the last block linear or the head
    assert len(buckets) > 3 and tail < sum(b for b, _ in buckets) / 2
    assert none == pytest.approx(d + sum(b for b, _ in buckets) / B, rel=1e-3)
    assert slow == pytest.approx(d + tail / B, rel=1e-3)


def test_breakdown_adds_up():
    s = spec("ours", pp=2, batch=2, slices=(64, 64), link=Link(0.005, 1e8), transport="gloo", dp=2,
             dp_mode="central_ps")
    p = predict(s, Fixed(0.01, 0.02, wgrad=0.3, overheads=Overheads(step=0.003, unit_layer=0.001, dp=0.002)), cores=2.0)
    assert sum(p.parts().values()) == pytest.approx(p.step_time, rel=1e-6)
    assert p.dp_sync > 0 and p.barrier > 0 and p.overhead > 0


def test_background_load_shares_the_cores():
    from predict.host_load import cores_with_background

    assert cores_with_background(2.0, 0.0)[:3] == (1.0, 2.0, 2.0)
    cores = cores_with_background(2.0, 2.0)
    assert cores[0] == pytest.approx(2 / 3) and cores[1] == pytest.approx(1.0)
    progs = [[Compute(1.0, "forward"), Mark("end")] for _ in range(2)]
    res = Simulator(progs, Network(FAST), cores=cores).run()
    assert res.marks[0]["end"][0] == pytest.approx(2.0)  # two ranks and two others on two cores: half a core each


def test_torch_interleaved_with_fewer_micro_batches_than_stages_runs_one_round():
    """torch's Interleaved1F1B runs m < P micro-batches as one round of m (the simulated program used
    Megatron's rounds of P and deadlocked on micro-batches that do not exist): with f + b = 0.03 s per
    layer and sequence, m micro-batches cost at least m times the work of one rank."""
    times = [predict(RunSpec("torch_pipe", MODEL, batch_size=m, micro_batch_size=1, link=FAST, pp=2,
                             schedule="interleaved"), Fixed(0.01, 0.02)).step_time for m in (1, 2, 4)]
    assert all(t >= m * 3 * 0.03 for t, m in zip(times, (1, 2, 4))) and times[0] < times[1] < times[2]


def test_ours_tensor_parallel_splits_the_compute_and_pays_its_all_reduces():
    """ours --tp 2 (ours.tp): a stage's two ranks are one simulated rank computing half of each layer,
    with 2 all-reduces per layer forward and 2 backward per unit, each at least one latency of the links
    between them."""
    fwd, bwd = 0.010, 0.020
    def ours(tp, intra):
        return RunSpec("ours", MODEL, batch_size=1, micro_batch_size=1, link=FAST, tp=tp, slices=(64, 64),
                       transport="nccl", intra_link=intra, ranks_per_host=2)
    one = predict(ours(1, FAST), Fixed(fwd, bwd)).step_time
    two = predict(ours(2, FAST), Fixed(fwd, bwd)).step_time
    assert two == pytest.approx(one / 2, rel=1e-6) and one == pytest.approx(MODEL.n_layer * (fwd + bwd), rel=1e-6)
    slow = predict(ours(2, Link(1e-3, 1e15)), Fixed(fwd, bwd)).step_time
    all_reduces = 4 * MODEL.n_layer * 2  # per layer 2 forward + 2 backward, 2 token slices
    assert slow - two >= all_reduces * 1e-3 * 0.999
