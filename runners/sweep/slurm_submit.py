"""Submitting a sweep to Slurm: a batch script written beside the results, then sbatch.

    python -m runners.sweep.slurm_submit SWEEP [sweep options] -- [sbatch options]
    (runners/run_all.sh [--sweep SWEEP] [options] --slurm-submit [sbatch options])

The sweep options are those of ``python -m runners.sweep`` (``--out``, ``--only``, ``--iface``,
``--nproc-per-node``, ``--scale-down`` ...), judged here before anything is submitted. The batch
script (RESULTS/NAME.sbatch, beside the record file RESULTS/NAME.jsonl) holds the sbatch options as
``#SBATCH`` lines, so that it can be read, edited and submitted again with plain ``sbatch``; it
runs ``runners/run_all.sh --slurm`` in this checkout (which every node must see at the same path)
with the same options. The job's output goes to RESULTS/NAME-slurm-JOBID.out. ``--no-kill`` is set:
a node that fails ends its run (recorded as an error naming it), not the whole sweep.

``--wait`` (``-W``) is given to sbatch itself, not written into the script: this command then
returns when the job has ended, with its exit status. Exit status otherwise: 0 submitted, 2 a bad
request or a submission Slurm refused, 1 an sbatch that exited 0 without naming a job.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from runners.sweep.__main__ import build_parser as sweep_parser
from runners.sweep.plan import REPO, SweepError, check_out, load_sweep, sweep_path
from runners.sweep.scale import scale_down

SUBMIT_ONLY = ("--wait", "-W")  # sbatch options about the submission itself: its command line, not the script
DEFAULTS = ("--no-kill",)  # a failed node ends its run, not the allocation
NOT_FOR_SUBMIT = ("hostfile", "ssh_config", "ssh_user", "networks", "dry_run")
# sbatch's answer naming the job: --parsable's "JOBID[;CLUSTER]", or the plain "Submitted batch job JOBID"
# (a site's sbatch wrapper may drop --parsable)
_SUBMITTED = re.compile(r"^(?:(\d+)(?:;\S+)?|Submitted batch job (\d+)\b.*)$")


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the sweep's arguments, sbatch's): they are apart at the first ``--``."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def without_out(args: Sequence[str]) -> list[str]:
    """The sweep's options without ``--out FILE`` (the script gives it, absolute)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif not a.startswith("--out="):
            out.append(a)
    return out


def output_of(sbatch_options: Sequence[str]) -> str | None:
    """The job output file the user's sbatch options name (``-o F``, ``--output F``, ``--output=F``)."""
    found = None
    for i, a in enumerate(sbatch_options):
        if a in ("-o", "--output") and i + 1 < len(sbatch_options):
            found = sbatch_options[i + 1]
        elif a.startswith("--output="):
            found = a.split("=", 1)[1]
        elif a.startswith("-o") and len(a) > 2:
            found = a[2:]
    return found


def batch_script(sweep: str, out: Path, options: Sequence[str], sbatch_options: Sequence[str], name: str,
                 python: str | None = None, repo: Path = REPO) -> str:
    """The batch script: ``#SBATCH`` lines (ours, then the user's, which win), then run_all.sh --slurm in
    ``repo`` with the sweep's ``options`` and ``--out out``."""
    script = out.with_suffix(".sbatch")
    command = ["bash", "runners/run_all.sh", "--slurm", "--sweep", sweep, *options, "--out", str(out)]
    lines = [
        "#!/bin/bash",
        f"# The sweep {name} across the nodes of a Slurm allocation: runners/run_all.sh --slurm places each",
        "# run on the allocation's nodes and starts it with srun + torchrun; records into the --out file.",
        f"# Written by runners/run_all.sh --slurm-submit on {time.strftime('%Y-%m-%d %H:%M:%S')}; edit it and",
        f"# submit it again with: sbatch {script}",
        f"#SBATCH --job-name=pipebench-{name}",
        f"#SBATCH --output={out.parent / (out.stem + '-slurm-%j.out')}",
        *(f"#SBATCH {o}" for o in DEFAULTS),
        *([f"#SBATCH {shlex.join(sbatch_options)}"] if sbatch_options else []),
        "set -euo pipefail",
        f"cd {shlex.quote(str(repo))}",
        *([f"export PYTHON={shlex.quote(python)}"] if python else []),
        f"exec {shlex.join(command)}",
        "",
    ]
    return "\n".join(lines)


def prepare(argv: Sequence[str]) -> tuple[Path, list[str], str]:
    """Judge the request and write the batch script: (its path, sbatch's command line options, the job
    output's path pattern). SweepError for a bad request."""
    sweep_args, sbatch_options = split_argv(argv)
    args = sweep_parser().parse_args(sweep_args)
    for dest in NOT_FOR_SUBMIT:
        if getattr(args, dest) not in (None, False):
            raise SweepError(f"--{dest.replace('_', '-')} does not go with --slurm-submit")
    if not args.sweep or sweep_args[:1] != [args.sweep]:
        raise SweepError("--slurm-submit needs the sweep file first")
    if args.slurm:
        raise SweepError("--slurm is the batch script's own; leave it out of --slurm-submit")
    sweep = load_sweep(args.sweep, scale_down if args.scale_down else None)  # a bad sweep stops here
    if shutil.which("sbatch") is None:
        raise SweepError("sbatch not found: --slurm-submit runs where Slurm's commands are (a cluster's login node)")
    out = Path(args.out or f"results/{sweep.name}.jsonl").absolute()
    check_out(out, [("sweep file", sweep_path(args.sweep))])
    sweep_file = str(Path(args.sweep).absolute()) if Path(args.sweep).exists() else args.sweep
    script = out.with_suffix(".sbatch")
    script.parent.mkdir(parents=True, exist_ok=True)
    submit_only = [o for o in sbatch_options if o in SUBMIT_ONLY]
    in_script = [o for o in sbatch_options if o not in SUBMIT_ONLY]
    tmp = script.with_name(script.name + ".tmp")
    tmp.write_text(batch_script(sweep_file, out, without_out(sweep_args[1:]), in_script, sweep.name,
                                os.environ.get("PYTHON")))
    tmp.replace(script)
    output = output_of(in_script) or str(out.parent / (out.stem + "-slurm-%j.out"))
    return script, submit_only, output


def submit(script: Path, submit_only: Sequence[str], output: str, stream=None) -> int:
    """sbatch the script; with --wait, until the job ends (its exit status)."""
    stream = stream or sys.stdout
    p = subprocess.Popen(["sbatch", "--parsable", *submit_only, str(script)], stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stderr is not None
    try:
        job, said = job_id(p.stdout)
        if job is None:
            rc = p.wait()
            errors = [l for l in p.stderr.read().strip().splitlines() if l.strip()] or said[-1:] or [f"exit {rc}"]
            if rc == 0:
                print(f"slurm-submit: sbatch exited 0 without naming a job ({errors[-1]}): see squeue whether it was "
                      f"submitted; batch script: {script}", file=sys.stderr)
                return 1
            print(f"slurm-submit: sbatch refused the job: {errors[-1]}", file=sys.stderr)
            return 2
        print(f"slurm-submit: submitted batch job {job}; output: {output.replace('%j', job)}; batch script: {script}",
              file=stream, flush=True)
        if not submit_only:
            print(f"slurm-submit: follow it with: tail -f {output.replace('%j', job)}; stop it with: scancel {job}",
                  file=stream, flush=True)
            p.wait()
            return 0
        rc = p.wait()
        print(f"slurm-submit: job {job} ended with exit status {rc}", file=stream, flush=True)
        return rc
    except KeyboardInterrupt:
        print("slurm-submit: interrupted; the job (if submitted) goes on: scancel it to stop it", file=sys.stderr)
        return 130
    finally:
        if p.poll() is None:
            p.terminate()
            p.wait()


def job_id(stdout) -> tuple[str | None, list[str]]:
    """The job id sbatch names on ``stdout`` (lines read until it comes: with --wait, sbatch goes on
    running after it), or None; and the lines read."""
    said = []
    for line in stdout:
        said.append(line.strip())
        m = _SUBMITTED.match(said[-1])
        if m:
            return m.group(1) or m.group(2), said
    return None, said


def main(argv: Sequence[str] | None = None) -> int:
    try:
        script, submit_only, output = prepare(sys.argv[1:] if argv is None else argv)
    except SweepError as e:
        print(f"run_all.sh --slurm-submit: error: {e}", file=sys.stderr)
        return 2
    return submit(script, submit_only, output)


if __name__ == "__main__":
    sys.exit(main())
