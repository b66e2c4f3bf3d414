"""Sweeps: a sweep file expanded into run commands (``plan``), run one after another locally or
across a cluster's hosts over ssh (``execute``, ``cluster``); ``python -m runners.sweep`` (``__main__``)."""
