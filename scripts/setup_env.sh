#!/usr/bin/env bash
# Create .venv (if missing) and install the suite with pinned dependencies. Idempotent.
#   bash scripts/setup_env.sh                      torch==2.13.0: the CPU build where there is no NVIDIA GPU
#                                                  (CI); on a host with NVIDIA GPUs the CUDA build of 2.13.0
#                                                  that its driver and GPUs run (python -m scripts.torch_build)
#   bash scripts/setup_env.sh --cuda cu126         that CUDA build of torch 2.13.0, chosen by hand
#   bash scripts/setup_env.sh --use-system-torch   the torch of $PYTHON (python3) as it is, 2.9 to 2.13: the venv
#                                                  sees its packages; a pinned dependency missing there is
#                                                  installed, one present is used at its version
#   --wheels DIR                                   install from the wheels in DIR only (a machine without an index)
# torch is pinned: on machines with a local CPU wheel it comes from there; a range or plain "torch"
# would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
system_torch=0 cuda="" wheels=""
while [ $# -gt 0 ]; do
  case "$1" in
    --use-system-torch) system_torch=1 ;;
    --cuda) cuda=${2:?--cuda needs a build, e.g. cu126}; shift ;;
    --wheels) wheels=$(realpath "${2:?--wheels needs a directory}"); shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "setup: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ "$system_torch" = 1 ]; then
  mode=system
elif [ -n "$cuda" ]; then
  mode=$cuda
elif command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  mode=$("$PY" -m scripts.torch_build choose)  # one line on stderr and exit 1 where none fits
else
  mode=cpu
fi
pip_from=()
[ -n "$wheels" ] && pip_from=(--no-index --find-links "$wheels")
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv" >&2
  "$PY" -m venv .venv
fi
# The stamp names pyproject.toml (runners.sweep.setup_nodes checks it); it holds the torch mode
# (an empty stamp is the CPU build's, as stamps were before the mode was written).
stamp=.venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)
installed=none
[ -f "$stamp" ] && installed=$(cat "$stamp") && installed=${installed:-cpu}
if [ "$installed" != "$mode" ]; then
  pip=(.venv/bin/pip install -q --disable-pip-version-check "${pip_from[@]}")
  purelib=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  rm -f "$purelib/_system_torch.pth"
  if [ "$mode" != cpu ]; then  # another build (a torch 2.13.0 of another mode would count as installed)
    .venv/bin/pip uninstall -y -q torch >/dev/null 2>&1 || true
  fi
  case "$mode" in
    cpu)
      echo "setup: installing dependencies into .venv (torch==2.13.0, fairscale, megatron-core, pandas ...)" >&2
      "${pip[@]}" torch==2.13.0
      "${pip[@]}" -e ".[test]" ;;
    system)
      site=$("$PY" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))') \
        || { echo "setup: --use-system-torch: $PY has no torch" >&2; exit 1; }
      echo "$site" > "$purelib/_system_torch.pth"
      .venv/bin/python -m scripts.torch_build check
      mapfile -t need < <(.venv/bin/python -m scripts.torch_build missing)
      if [ "${#need[@]}" -gt 0 ]; then
        echo "setup: installing what $site lacks: ${need[*]}" >&2
        "${pip[@]}" "${need[@]}"
      fi ;;
    *)
      echo "setup: installing torch==2.13.0 ($mode: the CUDA build this machine's driver and GPUs run) and the rest" >&2
      if [ -n "$wheels" ]; then "${pip[@]}" torch==2.13.0; else "${pip[@]}" torch==2.13.0 --index-url "https://download.pytorch.org/whl/$mode"; fi
      "${pip[@]}" -e ".[test]" ;;
  esac
  rm -f .venv/.installed-*
  echo "$mode" > "$stamp"
fi
# Network emulation tools (namespaces, tbf, iptables NFQUEUE): only root can use them; install if missing.
if [ "$(id -u)" = 0 ] && { ! command -v ip >/dev/null || ! command -v iptables >/dev/null || ! command -v tc >/dev/null; }; then
  if command -v apt-get >/dev/null; then
    echo "setup: installing iproute2 and iptables" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 iptables >/dev/null) \
      || echo "setup: could not install iproute2/iptables; network emulation tests will be skipped" >&2
  fi
fi
# Virtual nodes (tools.nodes) run their own sshd: install openssh-server if missing. The nodes
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
# Slurm on virtual nodes (run_all.sh --rehearse N --slurm, tools.slurm_nodes): Debian's slurm-wlm
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
# The quality race's text (--data pydocs): the Python documentation's reST sources as Debian's python3.X-doc
# installs them (X: the venv's Python). Without root or apt, pydocs falls back to the stdlib's sources.
docver=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_python_version())')
if [ ! -d "/usr/share/doc/python$docver/html/_sources" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing python$docver-doc (the Python documentation: --data pydocs)" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "python$docver-doc" >/dev/null) \
      || echo "setup: warning: could not install python$docver-doc; --data pydocs trains on the stdlib's sources" >&2
  else
    echo "setup: warning: no python$docver-doc here (installing it needs root and apt); --data pydocs trains on" \
         "the stdlib's sources" >&2
  fi
fi
