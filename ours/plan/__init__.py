"""TeraPipe's latency model and optimal token slicing (``python -m ours.plan``).

- ``ours.plan.solve``: the exact slicing DP over a latency table (``solve_table``, ``brute_force``);
- ``ours.plan.latency``: the latency model t(b, l, c) + communication, its fit (``LatencyModel``, ``fit``);
- ``ours.plan.planner``: model -> optimal (batch slice, token slicing) (``plan``);
- ``ours.plan.profile``: the measurements; ``bench.plan_evaluation``: predicted vs measured;
- ``ours.plan.auto``: ``auto_slicing(config, device)`` for ``--n-slices auto`` (ours' default).
"""
from ours.plan.latency import LatencyModel, fit
from ours.plan.planner import Plan, plan
from ours.plan.solve import Solution, brute_force, solve_table

__all__ = ["LatencyModel", "fit", "Plan", "plan", "Solution", "brute_force", "solve_table"]
