"""Benchmarks: scripts that run the run command many times and print medians, ratios and spreads
(``python -m bench NAME``): systems side by side (``__main__``), the network delays paid per step
(``network_slope``), ours' latency model against measured runs (``plan_evaluation``), and the check of
how many cores this machine really gives at once (``machine``), one layer's attention over a slice
(``attention``), where each rank's step time goes (``breakdown``), ours across sequence lengths
(``seq_sweep``) and what the side-by-side benchmarks share (``sittings``)."""


def cannot_run(args: list[str]) -> str | None:
    """Why the run command would refuse the request ``args`` (its own judgement), or None."""
    from contract import ConfigError
    from runners.request import judge, parse_request

    try:
        judge(*parse_request(args))
    except ConfigError as exc:
        return str(exc)
    return None
