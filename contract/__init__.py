"""The contract between the runner and every system: what a system is given, what it returns,
how it is timed, and how it declares itself. It imports nothing of the suite but ``workload``.

- ``contract.config``: ``RunConfig`` (the fields every run has), ``SystemOptions`` (the base of the
  fields a system declares for itself, with ``option``; ``PipelineOptions`` for a schedule and its
  model chunks per rank) and ``ConfigError``. Plain data, no torch.
- ``contract.spec``: ``Train``, the one function a system implements, ``train(config, context) ->
  Measurements``, its contract in its docstring; and ``SystemSpec``, a system's declaration: its name,
  its options, the parallel dimensions it supports, how many processes it needs, how its runs are
  labelled, and where its ``train`` lives. No torch.
- ``contract.registry``: every system by name (``systems``, ``get_system``), from the spec modules it
  lists and ``$PIPEBENCH_SYSTEMS``.
- ``contract.rank``: ``Context`` (what a rank is given), ``Measurements`` (what it returns),
  ``StepOutput`` and ``run_steps`` (the timing discipline: barrier, step, synchronise, barrier).
- ``contract.evaluation``: the held-out eval between steps (``--eval-every``), the same for every
  system, from the weights each system hands over; ``contract.traffic``: the bytes a rank has sent.
- ``contract.records``: the records file (a run record per JSON line) and the one way to read it.

A system imports this package and ``workload``, never the harness (``runners``), the simulator
(``predict``), the benchmarks or the report.
"""
from contract.config import ConfigError, PipelineOptions, RunConfig, SystemOptions, option
from contract.spec import SystemSpec, Train

__all__ = ["ConfigError", "PipelineOptions", "RunConfig", "SystemOptions", "SystemSpec", "Train", "option"]
