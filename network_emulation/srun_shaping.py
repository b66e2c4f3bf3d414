"""Shaping the nodes of a Slurm allocation through srun, and probing the links between them.

``SrunShapingSession`` is ``SshShapingSession`` with every node reached through ``srun`` instead of
ssh: on each node the same shaping agent (shaping_agent.py: netem where the node has it, else tbf
plus the delayer) runs as a one-task job step whose stdin, held open by srun, is the agent's
lifeline: the session's end, an exception, Ctrl-C or SIGTERM here close it, the agent clears. The
agent runs under the step guard (slurm_step.py), so that a node whose slurmd dies mid-session is
cleared too once Slurm has given the step up. ``probe`` / ``probe_links`` measure the links between
nodes with probe.py started the same way.

It must run inside the allocation (srun finds the job in SLURM_JOB_ID); the suite and its python
are at ``remote_dir`` / ``remote_python`` on every node (a shared file system, as on most Slurm
clusters). The delayer exempts no port here (there is no ssh connection to keep): Slurm's own
messages to a shaped node pay the delay too.
"""

from __future__ import annotations

import posixpath

from .probe import LinkMeasurement, measure_with
from .slurm_step import guarded, srun_argv
from .ssh_shaping import SshShapingSession, for_host


class SrunShapingSession(SshShapingSession):
    """Shape ``hosts`` (node names of the current allocation) for ``profile`` on ``iface`` through srun,
    and always clear afterwards; the same arguments and attributes as ``SshShapingSession``, without
    ``ssh_config``."""

    def _on(self, host: str | None, argv: list[str]) -> list[str]:
        if host is None:
            return argv
        return srun_argv([host], guarded(for_host(self.remote_python, host), argv),
                         chdir=for_host(self.remote_dir, host))

    def _measure(self, src: int, dst: int, *, samples: int, duration_s: float, train: int,
                 port: int) -> LinkMeasurement:
        """The probe's two ends on the hosts (indices into ``hosts``), each started through srun
        (``LinkProbing.probe``)."""
        server, client = self.hosts[dst], self.hosts[src]
        address = self.iface_addresses.get(server or "localhost") or server
        if not address:
            raise ValueError("probe: the destination's address is unknown (enter the session first)")
        stamp = "socket" if self.backends.get(server or "localhost") == "tbf+delayer" else "kernel"

        def on(host: str | None):
            def wrap(args: list[str]) -> list[str]:
                script = posixpath.join(for_host(self.remote_dir, host), "network_emulation", "probe.py")
                return self._on(host, [for_host(self.remote_python, host), "-I", script, *args])
            return wrap

        return measure_with(on(server), on(client), address, port=port, samples=samples, duration_s=duration_s,
                            train=train, stamp=stamp)
