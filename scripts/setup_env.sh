#!/usr/bin/env bash
# Create .venv (if missing) and install the suite with pinned dependencies. Idempotent.
# torch is installed first and pinned: on machines with a local CPU wheel it comes from there;
# a range or plain "torch" would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv" >&2
  "$PY" -m venv .venv
fi
stamp=.venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -f "$stamp" ]; then
  echo "setup: installing dependencies into .venv (torch==2.13.0, fairscale, megatron-core, pandas ...)" >&2
  .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
  .venv/bin/pip install -q --disable-pip-version-check -e ".[test]"
  rm -f .venv/.installed-*
  touch "$stamp"
fi
# Network emulation tools (namespaces, tbf, iptables NFQUEUE): only root can use them; install if missing.
if [ "$(id -u)" = 0 ] && { ! command -v ip >/dev/null || ! command -v iptables >/dev/null || ! command -v tc >/dev/null; }; then
  if command -v apt-get >/dev/null; then
    echo "setup: installing iproute2 and iptables" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 iptables >/dev/null) \
      || echo "setup: could not install iproute2/iptables; network emulation tests will be skipped" >&2
  fi
fi
# Virtual nodes (network_emulation.nodes) run their own sshd: install openssh-server if missing. The nodes
# never use /etc/ssh; where systemd runs, the machine-wide sshd the package would start is stopped again, so
# the machine is left as it was (without systemd the package starts no daemon).
if [ "$(id -u)" = 0 ] && ! command -v sshd >/dev/null && [ ! -x /usr/sbin/sshd ]; then
  if command -v apt-get >/dev/null; then
    echo "setup: installing openssh-server (virtual nodes' sshd)" >&2
    if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server >/dev/null); then
      if [ -d /run/systemd/system ]; then systemctl disable --now ssh.service ssh.socket >/dev/null 2>&1 || true; fi
    else
      echo "setup: could not install openssh-server; virtual node tests will be skipped" >&2
    fi
  fi
fi
# Slurm on virtual nodes (run_all.sh --rehearse N --slurm, network_emulation.slurm_nodes): Debian's slurm-wlm
# (slurmctld, slurmd, slurm-client) and munge, if missing. Without systemd the packages start no daemon; where
# systemd runs, the machine-wide daemons they would start are stopped again (the rehearsal runs its own).
if [ "$(id -u)" = 0 ] && ! { command -v slurmctld && command -v slurmd && command -v srun && command -v munged; } >/dev/null; then
  if command -v apt-get >/dev/null; then
    echo "setup: installing slurmctld, slurmd, slurm-client and munge (the Slurm rehearsal's)" >&2
    if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null); then
      if [ -d /run/systemd/system ]; then systemctl disable --now slurmctld slurmd munge >/dev/null 2>&1 || true; fi
    else
      echo "setup: could not install Slurm; the Slurm rehearsal tests will be skipped" >&2
    fi
  fi
fi
