"""``--n-slices auto`` (ours' default): the token slicing of a run, chosen before it starts.

- One stage (``pp`` = 1, tensor or data parallel only): one slice. Slicing pays only to fill a pipeline;
  with nothing to fill it only adds per-slice costs (the main job's T-2: K=1 0.73 s, the K=4 a search
  kept 0.93 s), so there is nothing to choose or time.
- A slicing chosen by simulation for the run's layout (pipeline stages, layers, batch, micro-batch),
  where one was written for the layer shape: ``<device>-h..-s..-v..-simulated.json`` in the plan
  directory, by ``python -m predict plan``. The simulator (predict) runs ours' program
  over a calibration of this machine and predicts the planner's own evaluation better than TeraPipe's
  formula (results/predict/NOTE.md); it simulates the formula's optimum at several granularities and
  the uniform slicings and keeps the fastest. ours reads its choice as data; it imports nothing of it.
- Else, with a fitted latency model for the layer shape, the planner's optimal slicing. A model is found
  as the file named by ``$OURS_PLAN_MODEL``, or in the plan directory (``$OURS_PLAN_DIR``, default
  ``ours/plan/fitted``) as ``<device>-h<hidden>-a<heads>-s<seq>-v<vocab>.json``,
  written by ``python -m ours.plan fit``; a model profiled at a longer sequence covers shorter ones
  (its measurements hold every slice length and context up to its own sequence).
- Without one, a rule of thumb (``rule_of_thumb``): K equal slices of at least 128 tokens, at most
  4 per stage, and never one slice when the sequence can be cut. Deterministic, no profiling at run time.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from ours import uniform_slices
from ours.plan.latency import LatencyModel
from ours.plan.planner import plan
from workload.configs import ModelConfig

MIN_SLICE_TOKENS = 128  # below this a slice's fixed costs dominate (measured on cpu-small: 64 tokens cost 2/3 of 128)
MAX_SLICES_PER_STAGE = 4


@dataclass(frozen=True)
class AutoSlicing:
    slices: tuple[int, ...]
    source: str  # how they were chosen: "planner (<model file>)" or "rule (<why>)"


def plan_dir() -> Path:
    return Path(os.environ.get("OURS_PLAN_DIR") or Path(__file__).resolve().parent / "fitted")


def cache_key(model: ModelConfig, device) -> str:
    kind = str(device).split(":")[0]  # a torch.device or "cpu" / "cuda"
    return f"{kind}-h{model.n_embd}-a{model.n_head}-s{model.seq_len}-v{model.vocab_size}"


def fitted_model_path(model: ModelConfig, device) -> Path | None:
    """The fitted latency model that covers ``model``'s layer shape on this device kind, if any:
    the exact sequence length first, else the shortest longer one."""
    explicit = os.environ.get("OURS_PLAN_MODEL")
    if explicit:
        return Path(explicit)
    kind = str(device).split(":")[0]
    pattern = re.compile(rf"^{kind}-h{model.n_embd}-a{model.n_head}-s(\d+)-v{model.vocab_size}\.json$")
    found = sorted((int(m.group(1)), p) for p in plan_dir().glob("*.json") if (m := pattern.match(p.name)))
    longer = [(s, p) for s, p in found if s >= model.seq_len]
    return longer[0][1] if longer else None


def default_granularity(seq_len: int) -> int:
    """8 tokens, coarser for sequences beyond 2048 tokens (at most 256 positions)."""
    return max(8, -(-seq_len // 256))


def rule_of_thumb(seq_len: int, n_stages: int) -> tuple[int, ...]:
    """K equal slices: as many as keep slices at 128 tokens or more, at most 4 per stage, at least 2."""
    k = max(2, min(seq_len // MIN_SLICE_TOKENS, MAX_SLICES_PER_STAGE * n_stages))
    return uniform_slices(seq_len, min(k, seq_len))


@dataclass(frozen=True)
class SimulatedChoice:
    """One layout's slicing chosen by simulation, and what the formula's optimum would cost there."""

    n_layer: int
    pp: int
    batch_size: int
    micro_batch_size: int
    slices: tuple[int, ...]
    simulated_seconds: float
    formula_slices: tuple[int, ...]
    formula_simulated_seconds: float
    candidates: int

    def fits(self, config) -> bool:
        return (self.n_layer, self.pp, self.batch_size, self.micro_batch_size) == (
            config.model.n_layer, config.pp, config.batch_size, config.micro_batch_size) and \
            sum(self.slices) == config.model.seq_len


def simulated_choices_path(model: ModelConfig, device) -> Path:
    return plan_dir() / f"{cache_key(model, device)}-simulated.json"


def read_simulated_choices(path: Path) -> list[SimulatedChoice]:
    if not path.is_file():
        return []
    rows = json.loads(path.read_text())["choices"]
    return [SimulatedChoice(**{**r, "slices": tuple(r["slices"]), "formula_slices": tuple(r["formula_slices"])})
            for r in rows]


def write_simulated_choices(path: Path, choices: list[SimulatedChoice]) -> None:
    """Add (or replace, per layout) ``choices`` in the file at ``path``."""
    key = lambda c: (c.n_layer, c.pp, c.batch_size, c.micro_batch_size)  # noqa: E731
    kept = {key(c): c for c in read_simulated_choices(path)}
    kept.update({key(c): c for c in choices})
    rows = [asdict(c) for _, c in sorted(kept.items())]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(dict(kind="ours.plan.simulated_choices", choices=rows), indent=1))
    tmp.replace(path)


def auto_slicing(config, device) -> AutoSlicing:
    """The slicing for ``config`` (K = config.pp stages, batch slice = config.micro_batch_size)."""
    m = config.model
    if config.pp == 1:
        return AutoSlicing((m.seq_len,), "rule (one stage, P=1: no pipeline to fill, one slice)")
    if not os.environ.get("OURS_PLAN_MODEL"):  # an explicit latency model file: the formula with it
        simulated = simulated_choices_path(m, device)
        chosen = next((c for c in read_simulated_choices(simulated) if c.fits(config)), None)
        if chosen is not None:
            return AutoSlicing(chosen.slices, f"simulator ({simulated.name})")
    path = fitted_model_path(m, device)
    if path is None:
        return AutoSlicing(rule_of_thumb(m.seq_len, config.pp),
                           f"rule (no fitted latency model for {cache_key(m, device)})")
    p = plan(LatencyModel.load(path), n_layer=m.n_layer, n_stages=config.pp, batch_size=config.batch_size,
             seq_len=m.seq_len, granularity=default_granularity(m.seq_len), batch_slices=[config.micro_batch_size])
    assert sum(p.slices) == m.seq_len
    return AutoSlicing(tuple(int(x) for x in p.slices), f"planner ({path.name})")
