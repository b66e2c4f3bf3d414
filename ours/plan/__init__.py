"""TeraPipe's latency model and optimal token slicing (``python -m ours.plan``), on the one compute model
(``workload.compute``).

- ``ours.plan.solve``: the exact slicing DP over a latency table and a fill table (``solve_table``,
  ``brute_force``);
- ``ours.plan.latency``: a slice's time and fill on a stage from ours' cost of a slice
  (``ComputeModel.slice_cost``) + communication (``slice_times``);
- ``ours.plan.planner``: model -> optimal (batch slice, token slicing), chosen together (``plan``, ``plan_for``);
- ``ours.plan.layout``: T, P and the slicing of ours on a cluster, from its links;
- ``ours.plan.profile``: this machine's profile of a layer's operations, of ours' slice and of ours'
  engine's own time per unit (the CPU's compute model);
- ``ours.plan.auto``: ``auto_slicing(config, device)`` for ``--n-slices auto`` (ours' default).
"""
from ours.plan.planner import Plan, plan, plan_for
from ours.plan.solve import Solution, brute_force, solve_table

__all__ = ["Plan", "plan", "plan_for", "Solution", "brute_force", "solve_table"]
