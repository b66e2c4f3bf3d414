"""Predict a run's step time without running it: a calibrated event simulation of every schedule.

- ``spec``: the run description (RunSpec, Link) and the answer (Prediction);
- ``engine``: the discrete-event simulator (ranks running programs, links with latency, bandwidth and
  messages in flight, cores shared by processes);
- ``collectives``: gloo's collectives message by message, NCCL's in closed form;
- ``programs``: what every rank runs in a step, per system and schedule;
- ``compute``: operation times from a profile of this machine or a GPU device file;
- ``predict``: ``predict(spec, compute)``.
"""
