"""Predict a run's step time without running it: a calibrated event simulation of every schedule.

- ``run_spec``: the run description (RunSpec, Cluster; a link is ``contract.links.Link``), what the
  simulator models, and the answer (Prediction);
- ``from_config``: a RunSpec, a GPU's compute model and the memory per GPU of the run command's RunConfig;
- ``scenario``, ``systems``: a run on a GPU cluster described whole, the systems it may name;
- ``simulator``: the discrete-event simulator (ranks running programs, links with latency, bandwidth and
  messages in flight, cores shared by processes);
- ``collectives``: gloo's collectives message by message, NCCL's rings (or in closed form);
- ``programs``: what every rank runs in a step, per system and schedule;
- ``step_time``: ``predict(spec, compute)``, the compute model being ``workload.compute``'s;
- ``this_machine``: this host's calibration, validation and the report's predictions.
"""
