"""Benchmarks: scripts that run the run command many times and print medians, ratios and spreads
(``python -m bench NAME``): systems side by side (``__main__``), the network delays paid per step
(``network_slope``), ours' latency model against measured runs (``plan_evaluation``), and the check of
how many cores this machine really gives at once (``machine``)."""
