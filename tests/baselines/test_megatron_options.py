"""megatron's options beyond the layout, judged before launch (single process): selective recompute, the
overlapped data parallelism, TransformerEngine's TP overlap (a scenario predicts it; this build cannot
run it). That they run, and match the reference, is ``test_megatron``'s distributed-optimizer launch."""
from __future__ import annotations

import pytest

from contract import ConfigError
from predict.scenario import parse
from runners.request import judge, parse_request

TINY = ("--system", "megatron", "--model", "tiny", "--tp", "2", "--batch-size", "2", "--micro-batch-size", "1")


@pytest.mark.parametrize("extra, message", [
    (("--recompute-granularity", "selective"), "--recompute-granularity selective says what --recompute runs again"),
    (("--dp", "2", "--overlap-param-gather"), "--overlap-param-gather needs --distributed-optimizer and"),
    (("--dp", "2", "--distributed-optimizer", "--overlap-param-gather"), "needs --distributed-optimizer and"),
    (("--tp-comm-overlap",), "--tp-comm-overlap overlaps sequence parallelism's collectives"),
    (("--sequence-parallel", "--tp-comm-overlap"), "needs TransformerEngine (its userbuffers)"),
])
def test_the_run_command_refuses_what_megatron_cannot_run_in_one_line(extra, message):
    with pytest.raises(ConfigError) as exc:
        judge(*parse_request([*TINY, *extra]))
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_the_options_megatron_runs_are_accepted_and_labelled():
    cfg, spec = parse_request([*TINY, "--dp", "2", "--recompute", "--recompute-granularity", "selective",
                               "--distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"])
    judge(cfg, spec)
    assert spec.run_label(cfg) == "megatron +distopt +overlap-grad +overlap-param +selective"
    plain, _ = parse_request([*TINY, "--recompute"])
    assert plain.options.recompute_granularity == "full" and spec.run_label(plain) == "megatron"


def test_a_scenario_predicts_tp_comm_overlap_which_this_build_cannot_run():
    sc = parse(dict(run=dict(system="megatron", model="tiny", tp=2, batch_size=2, micro_batch_size=1,
                             sequence_parallel=True, tp_comm_overlap=True),
                    cluster=dict(gpu="H100 SXM", nodes=1, gpus_per_node=2)))
    assert sc.config.options.tp_comm_overlap
