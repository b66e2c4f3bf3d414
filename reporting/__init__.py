"""The report: run records in, markdown tables and plots out (``report.py`` and ``pipebench report`` are
its command). It reads only run records (``contract.records``) and imports only ``contract`` and
``workload``: how a record was made is none of its business.

One module per job:

- ``frame``: the records read (run records only) and turned into a pandas frame, one row per run, its
  repetitions combined (``contract.estimate``);
- ``tables``: the tables shaped like the seed's (layouts, networks), every run, the failures;
- ``claims``: like-for-like comparisons from paired launches, and their wording;
- ``summary``: the opening prose, what produced the records and the claims of every table, per commit;
- ``quality``: the quality race (time, tokens and bytes to a held-out loss);
- ``plots``: step time against the delay, held-out loss against time and bytes;
- ``document``: the sections in order (``render``).
"""
from reporting.document import render
from reporting.frame import load_records, to_frame
from reporting.plots import plot_networks, plot_quality
from reporting.quality import (against_synchronous, crossing, quality_frame, quality_section, quality_target_lines,
                               quality_targets)

__all__ = ["render", "load_records", "to_frame", "plot_networks", "plot_quality", "against_synchronous", "crossing",
           "quality_frame", "quality_section", "quality_target_lines", "quality_targets"]
