"""The run command's flags come from the fields they set (RunConfig's, the model's, the optimizer's, the
placement's, every system's options): one source for a flag, its default and its help; and ``judge``
is the one place a request is refused."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from contract import ConfigError, RunConfig, option
from contract.registry import get_system
from runners import request
from runners.request import Placement, build_parser, judge, parse_request
from workload.configs import ModelConfig, OptimizerConfig

BASE = ["--system", "reference", "--model", "tiny", "--batch-size", "2", "--micro-batch-size", "1"]


def _actions() -> dict[str, argparse.Action]:
    return {a.dest: a for a in build_parser()._actions}


def test_every_field_declared_with_option_is_a_flag_with_its_default_and_help():
    actions = _actions()
    for cls in (RunConfig, Placement):
        for f, hint in request._flag_fields(cls):
            if dataclasses.is_dataclass(hint) and not f.metadata.get("choices"):  # the optimizer: its fields' flags
                continue
            a = actions[f.name]
            assert a.help == f.metadata["help"] and "--" + f.name.replace("_", "-") in a.option_strings, f.name
            if f.default is dataclasses.MISSING:
                assert a.required, f.name
            else:
                assert a.default == f.default and not a.required, f.name
    # the optimizer's fields set it (its defaults); the model's override the named model's
    assert actions["optimizer"].default == OptimizerConfig().kind and actions["lr"].default == OptimizerConfig().lr
    assert actions["n_layer"].option_strings == ["--num-layers", "--n-layer"] and actions["n_layer"].default is None
    assert not [f for f in dataclasses.fields(ModelConfig) if f.name != "name" and f.name not in actions]


def test_a_field_declared_with_option_is_all_it_takes_to_get_a_flag():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Settings:
        eval_every: int = option(0, "evaluate every N steps (0: never)", group="training")
        target_loss: float | None = option(None, "stop once the eval loss is below this", group="training")
        fast: bool = option(False, "a switch", group="run")
        nested: OptimizerConfig = option(help="the optimizer", default_factory=OptimizerConfig)

    p = argparse.ArgumentParser()
    request._add_fields(p, Settings)
    args = p.parse_args(["--eval-every", "5", "--target-loss", "2.5", "--fast", "--optimizer", "sgd"])
    assert (args.eval_every, args.target_loss, args.fast, args.optimizer, args.lr) == (5, 2.5, True, "sgd", 1e-4)
    assert request._from_args(OptimizerConfig, args) == OptimizerConfig(kind="sgd")
    assert [g.title for g in p._action_groups][-2:] == ["training", "run"]


def test_the_config_of_the_flags_and_defaults_from_runconfig():
    cfg, spec = parse_request([*BASE, "--num-layers", "2", "--lr", "0.001"])
    assert spec is get_system("reference")
    defaults = RunConfig(system="reference", model=cfg.model, batch_size=2, micro_batch_size=1)
    assert cfg == defaults.replace(optimizer=OptimizerConfig(lr=0.001))
    assert cfg.model.n_layer == 2 and cfg.model.n_embd == 128  # tiny's, overridden where given
    with pytest.raises(ConfigError, match="--n-slices is an option of ours, not of reference"):
        parse_request([*BASE, "--n-slices", "4"])


def test_judge_refuses_a_network_without_root_only_for_a_run_here(monkeypatch, tmp_path):
    cfg, spec = parse_request([*BASE, "--network", "d10-1g"])
    monkeypatch.setattr(request.os, "geteuid", lambda: 1000)
    judge(cfg, spec)  # the request itself is sound (a sweep plans it)
    with pytest.raises(ConfigError, match="needs root"):
        judge(cfg, spec, Placement(), str(tmp_path / "r.jsonl"))
    judge(cfg, spec, Placement(nnodes=2, node_rank=1, rdzv_endpoint="n0:29500"))  # shaped by the cluster mode
    with pytest.raises(ConfigError, match="--nnodes > 1 needs --rdzv-endpoint"):
        judge(cfg, spec, Placement(nnodes=2))
    inf, _ = parse_request([*BASE, "--timeout", "inf"])
    with pytest.raises(ConfigError, match="--timeout must be a finite number of seconds > 0, got inf"):
        judge(inf, spec)
