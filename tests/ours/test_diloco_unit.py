"""diloco without processes: its options and fragments, and its verification reference (the reference
with DiLoCo's outer step, ``reference --diloco``) run in this process with the harness's evals (one
rank: no process group needed)."""
from __future__ import annotations

import pytest
import torch

from baselines.reference import ReferenceOptions
from baselines.reference.train import train as reference_train
from contract import ConfigError, RunConfig
from contract.rank import Context
from contract.registry import get_system
from ours.diloco import SPEC, DiLoCoOptions
from workload.partition import fragment_names, split_units, stage_units
from workload.configs import OptimizerConfig, get_model_config
from workload.model import build_gpt

MODEL = get_model_config("tiny").with_overrides(n_embd=64, seq_len=32, vocab_size=256)


def config(system: str = "reference", options=None, **fields) -> RunConfig:
    base = dict(system=system, model=MODEL, batch_size=2, micro_batch_size=1, dp=1, steps=6, warmup=0,
                optimizer=OptimizerConfig(lr=3e-3), data="stdlib", options=options or ReferenceOptions(diloco=True))
    return RunConfig(**{**base, **fields})


def outer(**options) -> ReferenceOptions:
    return ReferenceOptions(diloco=True, **options)


def run(cfg: RunConfig):
    return reference_train(cfg, Context(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo",
                              config=cfg))


def test_options_are_judged():
    bad = {DiLoCoOptions(inner_steps=6, fragments=4): "multiple of --fragments",
           DiLoCoOptions(inner_steps=4, fragments=2, sync_delay=2): "--sync-delay must be in 0..1",
           DiLoCoOptions(fragment_alpha=1.5): "--fragment-alpha",
           DiLoCoOptions(quantize=True): "triton on CUDA only",
           DiLoCoOptions(n_slices=4): "need --pp > 1",
           DiLoCoOptions(inner_steps=8, fragments=4): "--fragments 4: a stage of 2 layers has only 3 units"}
    for options, message in bad.items():
        cfg = config("diloco", options, pp=2 if options.fragments == 4 else 1, dp=2)
        with pytest.raises(ConfigError, match=message):
            SPEC.validate(cfg)
    SPEC.validate(config("diloco", DiLoCoOptions(inner_steps=4, fragments=2, sync_delay=1, n_slices=2), pp=2, dp=2))
    assert SPEC.run_label(config("diloco", DiLoCoOptions(inner_steps=4, fragments=2, sync_delay=1))) == \
        "streaming diloco H=4 F=2 tau=1"
    ref = SPEC.reference(config("diloco", DiLoCoOptions(n_slices=2, inner_steps=4), pp=2, dp=2))
    assert ref.system == "reference" and ref.pp == 2 and ref.dp == 2 and ref.options == outer(inner_steps=4)
    plain = config(options=ReferenceOptions())
    assert plain.options.identity() == {} and "inner_steps" in ref.options.identity()
    with pytest.raises(ConfigError, match="only with --diloco"):
        get_system("reference").validate(config(options=ReferenceOptions(), dp=2))


def test_fragments_cut_each_stage_in_model_order():
    assert stage_units(4, 2, 0) == [("wte", "wpe"), ("blocks.0",), ("blocks.1",)]
    assert split_units(stage_units(4, 2, 1), 2) == [[("blocks.2",), ("blocks.3",)], [("ln_f", "lm_head")]]
    names = fragment_names(MODEL, 2, 2)  # fragment f of the model: fragment f of every stage
    assert names[1] == [f"blocks.1.{n}" for n in ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
                                                    "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight",
                                                    "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                                                    "mlp.c_proj.weight", "mlp.c_proj.bias")] + \
        ["ln_f.weight", "ln_f.bias", "lm_head.weight"]
    assert sorted(n for f in names for n in f) == sorted(n for n, _ in build_gpt(MODEL, 0).named_parameters())


def test_one_replica_averaging_every_step_is_the_reference():
    """D = 1, H = 1, outer SGD lr 1 without momentum: the outer step puts back the replica's own
    weights, so DiLoCo's math is plain training, and so are its evals."""
    sim = run(config(options=outer(inner_steps=1, outer_lr=1.0, outer_momentum=0.0), eval_every=3))
    ref = run(config(options=ReferenceOptions(), eval_every=3))
    assert sim.losses == pytest.approx(ref.losses, abs=1e-6)
    assert [e["step"] for e in sim.evals] == [0, 3, 6]
    assert [e["loss"] for e in sim.evals] == pytest.approx([e["loss"] for e in ref.evals], abs=1e-6)
    assert sim.evals[-1]["tokens"] == 6 * 2 * MODEL.seq_len and sim.evals[-1]["wall_time"] > 0


def test_outer_steps_change_the_training():
    plain = run(config(options=outer(inner_steps=2, outer_lr=1.0, outer_momentum=0.0), dp=2))
    nesterov = run(config(options=outer(inner_steps=2), dp=2))
    assert plain.losses[:2] == nesterov.losses[:2]  # the first outer step comes after step 2
    assert nesterov.extra["eval_weights_every"] == 2  # the global weights change at each outer step
    assert abs(plain.losses[2] - nesterov.losses[2]) > 1e-4


def test_the_run_ends_one_step_after_the_eval_at_the_target():
    options = outer(inner_steps=1)
    first = run(config(options=options, eval_every=1, steps=8))
    target = (first.evals[2]["loss"] + first.evals[3]["loss"]) / 2  # reached at the eval after step 3
    stopped = run(config(options=options, eval_every=1, steps=8, target_loss=target))
    assert [e["step"] for e in stopped.evals] == [0, 1, 2, 3]  # the step after the target is not evaluated
    assert len(stopped.losses) == 4 and stopped.losses == first.losses[:4]
    assert len(stopped.step_times) == 4


def test_torchft_through_its_public_api_only_waiting_on_no_sleep():
    """Issue #53 item 7: the ranks' training reached into torchft's private attributes (DiLoCo's
    fragments' backups) and waited for heartbeats with a sleep; no name with a leading underscore of
    anything, no sleep, no function over 80 lines."""
    import ast
    from pathlib import Path

    import ours.diloco.train as module

    tree = ast.parse(Path(module.__file__).read_text())
    private = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr.startswith("_")
               and not n.attr.startswith("__")]
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                and (n.module or "").startswith("torchft") for a in n.names]
    assert not private and imported and not [name for name in imported if name.startswith("_")]
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "sleep"]
    long = [f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.end_lineno - f.lineno >= 80]
    assert not long, long


def test_the_global_weights_are_those_of_each_outer_step():
    """What the eval sees: the fragments' weights right after their outer step, before torchft mixes the
    local ones back in (--fragment-alpha), and a healed replica's as it healed."""
    from ours.diloco.train import GlobalWeights

    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    named = [(f"a.{n}", p) for n, p in first.named_parameters()] + [(f"b.{n}", p) for n, p in second.named_parameters()]
    outer = [torch.optim.SGD(m.parameters(), lr=1.0) for m in (first, second)]
    kept = GlobalWeights(named, [first, second], outer)
    start = {n: t.clone() for n, t in kept.values.items()}
    for p in first.parameters():
        p.grad = torch.ones_like(p)
    outer[0].step()
    after = {n: p.detach().clone() for n, p in named}
    with torch.no_grad():  # the local weights mixed back in
        for p in first.parameters():
            p.add_(5.0)
    assert torch.equal(kept.values["a.weight"], after["a.weight"]) and not torch.equal(after["a.weight"],
                                                                                      start["a.weight"])
    assert torch.equal(kept.values["b.weight"], start["b.weight"])  # its fragment took no outer step
