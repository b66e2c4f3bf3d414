#!/usr/bin/env bash
# The whole comparison.
#
#   runners/run_all.sh                      # local default: set up .venv, run sweeps/local.toml
#                                           # on this machine, predict its runs where the simulator is calibrated
#                                           # (python -m predict records), report into results/local.md (+ results/plots)
#   runners/run_all.sh --hostfile HOSTS [--ssh-config FILE] [--iface eth0] [--sweep FILE] [--nproc-per-node N]
#                      [--ssh-user USER] [--remote-dir DIR] [--setup-nodes [--share-venv VENV]]
#                                           # the cluster: every run across the hosts over ssh, the network
#                                           # shaped on each node (default sweep: sweeps/gpt3-xl-cluster.toml);
#                                           # HOSTS lines are 'host slots=GPUS'; --setup-nodes first copies the
#                                           # suite to every node's DIR and builds its environment there
#                                           # (--share-venv: nodes sharing this file system link this venv)
#   runners/run_all.sh --slurm [--sweep FILE] [--iface eth0] [--nproc-per-node N]
#                                           # inside a Slurm allocation: its nodes and GPUs per node, every run
#                                           # started with srun + torchrun, the network shaped through srun
#   runners/run_all.sh [--sweep FILE] [options] --slurm-submit [SBATCH_OPTION...] [-- OPTION...]
#                                           # write results/NAME.sbatch (runs --slurm with these options) and
#                                           # sbatch it; --wait waits for the job (docs/clusters-slurm.md)
#   runners/run_all.sh --quality            # the quality race on this machine (root): sweeps/quality-target.toml
#                                           # (synchronous training for the token budget: the target, report.py
#                                           # --quality-target), then sweeps/quality.toml to it: time, tokens and
#                                           # bytes to the held-out loss, report into results/quality.md
#   runners/run_all.sh --rehearse N [--slurm] [--sweep FILE] [--nproc-per-node N]
#                                           # rehearse the cluster on this machine (root): N virtual nodes with
#                                           # sshd, set-up, the sweep scaled down over ssh, report, nodes down;
#                                           # --slurm: slurmctld + slurmd on the nodes, the sweep submitted there
#
# Other options go to the sweep (python -m runners.sweep --help): --repeats N (launches of every run, each
# its own record; default: the sweep file's 'repeats'), --dry-run, --only SYSTEM, --out FILE,
# --retry-failed, --sudo, --remote-python PY, --port N, --scale-down (with --rehearse: --out, --only,
# --retry-failed, --dir DIR, --no-report).
# PYTHON=/path/to/python skips the environment set-up and uses that interpreter.
# A sweep that is run again skips the runs already in its record file.
set -euo pipefail
cd "$(dirname "$0")/.."

hostfile="" sweep="" rehearse="" setup_nodes="" dry_run="" no_report="" out="" slurm="" submit="" quality=""
cluster_args=() setup_args=() slots=() extra=() sbatch_args=() given=()
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }
need() { [ $# -ge 2 ] || { echo "run_all.sh: $1 needs a value" >&2; exit 2; }; }
# a flag that names what runs is given once: a second one would silently win over the first
once() {
  [[ " ${given[*]:-} " != *" $1 "* ]] || { echo "run_all.sh: $1 given twice: give it once" >&2; exit 2; }
  given+=("$1")
}
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --hostfile) need "$@"; once "$1"; hostfile=$2; shift 2 ;;
    --sweep) need "$@"; once "$1"; sweep=$2; shift 2 ;;
    --quality) once "$1"; quality=1; shift ;;
    --rehearse) need "$@"; once "$1"; rehearse=$2; shift 2 ;;
    --setup-nodes) setup_nodes=1; shift ;;
    --ssh-config|--ssh-user|--remote-dir) need "$@"; cluster_args+=("$1" "$2"); setup_args+=("$1" "$2"); shift 2 ;;
    --share-venv) need "$@"; setup_args+=("$1" "$2"); shift 2 ;;
    --dry-run) dry_run=1; extra+=("$1"); shift ;;
    --no-report) no_report=1; extra+=("$1"); shift ;;
    --out) need "$@"; once "$1"; out=$2; extra+=("$1" "$2"); shift 2 ;;
    --repeats) need "$@"; extra+=("$1" "$2"); shift 2 ;;
    --iface) need "$@"; cluster_args+=("$1" "$2"); shift 2 ;;
    --nproc-per-node) need "$@"; slots=("$1" "$2"); shift 2 ;;
    --slurm) slurm=1; shift ;;
    --slurm-submit) submit=1; shift  # sbatch's options follow, up to '--'
      while [ $# -gt 0 ] && [ "$1" != "--" ]; do sbatch_args+=("$1"); shift; done
      [ $# -eq 0 ] || shift ;;
    *) extra+=("$1"); shift ;;
  esac
done

if [ -n "$quality" ]; then
  [ -z "$sweep" ] || { echo "run_all.sh: --quality runs sweeps/quality.toml; leave out --sweep $sweep (or give --sweep alone)" >&2; exit 2; }
  sweep=sweeps/quality.toml
fi
if [ -n "$rehearse" ]; then
  [ -z "$dry_run" ] || { echo "run_all.sh: --rehearse brings nodes up and has no --dry-run (try --sweep FILE --scale-down --dry-run)" >&2; exit 2; }
  [ -z "$hostfile" ] || { echo "run_all.sh: --rehearse makes its own nodes; leave out --hostfile" >&2; exit 2; }
  for a in ${cluster_args[0]+"${cluster_args[0]}"} ${setup_args[0]+"${setup_args[0]}"}; do
    echo "run_all.sh: $a is set by --rehearse itself" >&2; exit 2
  done
  [ -z "$setup_nodes" ] || { echo "run_all.sh: --rehearse sets up its nodes itself; leave out --setup-nodes" >&2; exit 2; }
  [ -z "$submit" ] || { echo "run_all.sh: --rehearse --slurm submits the sweep itself; leave out --slurm-submit" >&2; exit 2; }
elif [ -n "$slurm" ] || [ -n "$submit" ]; then
  what=${slurm:+--slurm}; what=${what:---slurm-submit}
  [ -z "$slurm" ] || [ -z "$submit" ] || { echo "run_all.sh: --slurm-submit writes a batch script that runs --slurm; give one of them" >&2; exit 2; }
  [ -z "$hostfile" ] || { echo "run_all.sh: $what takes its nodes from the Slurm allocation; leave out --hostfile" >&2; exit 2; }
  for a in ${setup_nodes:+--setup-nodes} ${setup_args[0]+"${setup_args[0]}"}; do
    echo "run_all.sh: $a is for a cluster over ssh (--hostfile), not for $what" >&2; exit 2
  done
elif [ -n "$hostfile" ] && [ -z "$setup_nodes" ] && [[ " ${setup_args[*]:-} " == *" --share-venv "* ]]; then
  echo "run_all.sh: --share-venv goes with --setup-nodes" >&2; exit 2
elif [ -z "$hostfile" ]; then
  for a in ${cluster_args[0]+"${cluster_args[0]}"} ${slots[0]+"${slots[0]}"} ${setup_nodes:+--setup-nodes} \
           ${setup_args[0]+"${setup_args[0]}"}; do
    echo "run_all.sh: $a needs --hostfile" >&2; exit 2
  done
fi

if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
else
  bash scripts/setup_env.sh
  PY=.venv/bin/python
fi

status=0
if [ -n "$rehearse" ]; then
  "$PY" -m tools.rehearse "$rehearse" ${slurm:+--slurm} ${sweep:+--sweep "$sweep"} ${slots[@]+"${slots[@]}"} \
    ${extra[@]+"${extra[@]}"} || status=$?
elif [ -n "$slurm" ]; then
  "$PY" -m runners.sweep "${sweep:-sweeps/gpt3-xl-cluster.toml}" --slurm --plots results/plots \
    ${cluster_args[@]+"${cluster_args[@]}"} ${slots[@]+"${slots[@]}"} ${extra[@]+"${extra[@]}"} || status=$?
elif [ -n "$submit" ]; then
  "$PY" -m runners.sweep.slurm_submit "${sweep:-sweeps/gpt3-xl-cluster.toml}" \
    ${cluster_args[@]+"${cluster_args[@]}"} ${slots[@]+"${slots[@]}"} ${extra[@]+"${extra[@]}"} \
    -- ${sbatch_args[@]+"${sbatch_args[@]}"} || status=$?
elif [ -z "$hostfile" ]; then
  sweep=${sweep:-sweeps/local.toml}
  if [ "$(id -u)" != 0 ]; then
    echo "run_all.sh: not root: the runs under emulated networks (network namespaces, tc) will be skipped;" \
         "run as root for the network experiment" >&2
  fi
  # the report after the simulator's predictions (a run never predicts itself): records in --out, else
  # results/<the sweep file's name>.jsonl
  [ -n "$out" ] || { out=results/$(basename "$sweep" .toml).jsonl; extra+=(--out "$out"); }
  if [ "$sweep" = sweeps/quality.toml ]; then
    # the race's target: the held-out loss synchronous training reaches at the token budget (same records file)
    "$PY" -m runners.sweep sweeps/quality-target.toml --no-report ${extra[@]+"${extra[@]}"} || exit $?
    if [ -n "$dry_run" ]; then
      echo "# the race's --target-loss: python report.py --quality-target $out, once the runs above are recorded"
    else
      target=$("$PY" report.py --quality-target "$out") || exit $?
      echo "quality race: target $target (the median held-out loss of synchronous training at the token budget)" >&2
      extra+=(--set "target_loss=$target")
    fi
  fi
  "$PY" -m runners.sweep "$sweep" --no-report --speed-probes ${extra[@]+"${extra[@]}"} || status=$?
  if [ -z "$dry_run$no_report" ] && [ "$status" != 2 ] && [ -f "$out" ]; then
    "$PY" -m predict records "$out" || true
    "$PY" report.py "$out" --out "${out%.jsonl}.md" --plots results/plots
    echo "report: ${out%.jsonl}.md"
  fi
else
  sweep=${sweep:-sweeps/gpt3-xl-cluster.toml}
  if [ -n "$setup_nodes" ] && [ -n "$dry_run" ]; then
    echo "# would set up the nodes first: $PY -m runners.sweep.setup_nodes --hostfile $hostfile ${setup_args[*]:-}"
  elif [ -n "$setup_nodes" ]; then
    "$PY" -m runners.sweep.setup_nodes --hostfile "$hostfile" ${setup_args[@]+"${setup_args[@]}"} || exit $?
  fi
  "$PY" -m runners.sweep "$sweep" --hostfile "$hostfile" --plots results/plots \
    ${cluster_args[@]+"${cluster_args[@]}"} ${slots[@]+"${slots[@]}"} ${extra[@]+"${extra[@]}"} || status=$?
fi
exit $status
