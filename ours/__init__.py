"""ours: the project's own system — a token-level pipeline (TeraPipe) with all-reduce or
parameter-server data parallelism.

- ``ours.system``: ``train(config, context)``, the entry point the runner calls.
- ``ours.engine``: one stage's token-sliced pipeline step (forward in slice order, backward in reverse,
  asynchronous point-to-point transfers, deferred weight gradients that fill the bubble).
- ``ours.kernels``: the exact sliced attention Function (KV state, gradient accumulation for earlier
  slices) and the deferred-gradient linear.
- ``ours.dp``: allreduce, central_ps and sharded_ps data parallelism.
- ``ours.trace``: the measured schedule as a Chrome trace.
- ``ours.plan``: the latency model and slicing planner (``--n-slices auto``).
"""
