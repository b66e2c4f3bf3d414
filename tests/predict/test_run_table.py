"""One schema for a run: a scenario's [run], `pipebench run --config FILE.toml` and a sweep's settings read
the same table into the same RunConfig; the systems, schedules and options come from the registry
(and predict.systems' one predicted-only system), never a second list in predict/."""
from __future__ import annotations

import subprocess
import sys

from predict.scenario import load
from runners.request import parse_request
from runners.sweep.plan import load_sweep
from tests.conftest import REPO

RUN = """[run]
system = "ours"
model = "tiny"
num_layers = 6
pp = 2
batch_size = 4
micro_batch_size = 2
n_slices = 4
schedule = "gpipe"
optimizer = "sgd_momentum"
recompute = true
precision = "bf16"
"""
CLUSTER = """
[cluster]
gpu = "H100 SXM"
nodes = 1
gpus_per_node = 2
"""


def test_one_file_is_a_scenarios_run_and_the_run_commands_config(tmp_path):
    f = tmp_path / "both.toml"
    f.write_text(RUN + CLUSTER)
    scenario = load(f)
    cfg, spec = parse_request(["--config", str(f)])
    assert scenario.config == cfg and spec.name == "ours"
    assert (cfg.model.n_layer, cfg.batch_size, cfg.optimizer.kind, cfg.options.n_slices) == (6, 4, "sgd_momentum", 4)
    # the command line's flags override the file's, torchtitan's way
    over, _ = parse_request(["--pp", "1", "--config", str(f), "--n-slices", "2"])
    assert over == cfg.replace(pp=1, options=cfg.options.__class__(**{**cfg.options.to_dict(), "n_slices": 2}))
    # a sweep's settings are the same keys: the same run, the same identity
    table = dict(line.split(" = ", 1) for line in RUN.splitlines()[1:])
    fixed = "\n".join(f"{k} = {v}" for k, v in table.items() if k not in ("system", "pp", "micro_batch_size",
                                                                         "n_slices", "schedule"))
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(f'name = "one"\n[fixed]\n{fixed}\n[[experiment]]\nname = "e"\nlayouts = ["P-2"]\n'
                     'micro_batch_sizes = [2]\n[[experiment.systems]]\nname = "ours"\nn_slices = 4\n'
                     'schedule = "gpipe"\n')
    (run,) = load_sweep(sweep).valid_runs
    assert run.key == cfg.key()


def test_the_run_command_reads_config_and_judges_it_as_its_flags(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text(RUN)
    run = lambda *a: subprocess.run([sys.executable, "-m", "runners.run", *a], cwd=REPO,  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    p = run("--config", str(f), "--micro-batch-size", "3", "--out", str(tmp_path / "r.jsonl"))
    assert p.returncode == 2 and p.stderr.strip().endswith("--batch-size 4 is not divisible by --micro-batch-size 3")
    f.write_text(RUN.replace('"bf16"', '"fp8"'))
    p = run("--config", str(f))
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "--config " + str(f) + ": [run]: precision = 'fp8' is not one of fp32, bf16, fp16" in p.stderr
    for text, why in (("system = 'ours'\n", "system stands outside [run]"), ("[other]\n", "no [run] table")):
        f.write_text(text)
        p = run("--config", str(f))
        assert p.returncode == 2 and why in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "r.jsonl").exists()


def test_predict_declares_no_second_list_of_systems_schedules_or_options():
    found = subprocess.run(["grep", "-rn", "--include=*.py", r"SYSTEMS\|SCHEDULES\|DP_MODES", "predict/"], cwd=REPO,
                           capture_output=True, text=True)
    assert found.stdout == "", found.stdout
