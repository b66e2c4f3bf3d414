"""The report as one markdown document: its sections in the order a reader wants them (the answer first,
then the tables that back it, then every run)."""
from __future__ import annotations

from reporting.frame import to_frame
from reporting.quality import quality_section, quality_target_lines
from reporting.summary import predictions, provenance, summary
from reporting.tables import all_runs, failures, layout_tables, network_tables, table_groups


def render(records: list[dict], target: float | None = None) -> str:
    """The report of ``records``: provenance, the quality race's target, the summary of claims, the
    layout and network tables, time to quality (``target``: for runs recorded without --target-loss),
    every run and the failures."""
    df = to_frame(records)
    if df.empty:
        return "No run records found.\n"
    layouts, networks = table_groups(df, emulated=False), table_groups(df, emulated=True)
    commits = list(dict.fromkeys(df["commit"]))  # in the order their runs were recorded: the newest last
    parts = ["# Results", provenance(records)[0], *quality_target_lines(records), summary(layouts, networks, commits),
             predictions(df)]
    net, lay = network_tables(networks), layout_tables(layouts)
    if lay:
        parts += ["## Layouts (no network emulation)", *lay]
    if net:
        parts += ["## Networks (emulated)", *net]
    parts.append(quality_section(records, target))  # runs with eval points: time to a loss
    parts += [all_runs(df), failures(df)]
    return "\n\n".join(p for p in parts if p) + "\n"
