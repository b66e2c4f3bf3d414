"""network_emulation: emulate the seed's network settings (delay, bandwidth) for the benchmarks.

- ``profiles``: named profiles (``none``, ``default``, ``d1-5g``, ``d5-2g``, ``d10-1g``, ``d50-1g``),
  ``parse_profile("delay 10ms bandwidth 1Gbps")`` and per-link matrices from JSON
  (``{"delay_ms": [[...]], "bandwidth_gbps": [[...]]}``); bad values raise ``ProfileError``.
- ``netem``: ``tc ... netem`` command building, applying and clearing on real hosts, locally or over
  ssh, with dry run; ``NetemSession`` always clears afterwards (exceptions, SIGINT, SIGTERM).
- ``virtual_cluster``: ``VirtualCluster(n_hosts, profile)``, one network namespace per host on a bridge,
  shaped by netem when the kernel has it, else by tbf plus a userspace nfnetlink_queue delayer;
  torn down on exit, on signals, and (after SIGKILL) by the next start or ``cleanup_stale()``.
- ``probe``: measured one-way delay and TCP bandwidth between two hosts of a cluster.
- ``ssh_shaping``: ``SshShapingSession``, the cluster mode's shaping over ssh, netem where a node
  has it, else tbf plus the delayer on the node (shaping_agent.py runs there); probes over ssh.

Command line: ``python -m network_emulation {apply,clear,show,probe,cleanup} --help``.
Needs root, iproute2 and (for the fallback) iptables. Virtual nodes with sshd and Slurm are tools
(``tools.nodes``, ``tools.slurm_nodes``).
"""

from .netem import NetemSession, NotRootError, netem_limit, tbf_burst
from .probe import LinkMeasurement
from .profiles import (PROFILES, SEED_PROFILES, LinkSpec, MatrixProfile, Profile, ProfileError, UniformProfile,
                       load_matrix, matrix_profile, parse_profile)
from .ssh_shaping import SshShapingSession, probe_over_ssh
from .virtual_cluster import VirtualCluster, VirtualHost, cleanup_stale

__all__ = [
    "PROFILES", "SEED_PROFILES", "LinkMeasurement", "LinkSpec", "MatrixProfile", "NetemSession", "NotRootError",
    "Profile", "ProfileError", "SshShapingSession", "UniformProfile", "VirtualCluster", "VirtualHost",
    "cleanup_stale", "load_matrix", "matrix_profile", "netem_limit", "parse_profile", "probe_over_ssh", "tbf_burst",
]

