"""The checks that prove the CUDA path on one machine with one GPU (scripts/gpu_check.sh).

    python -m tools.gpu_check [--out FILE.md] [--only CHECK]... [--steps N] [--run-timeout S] [--jobs J]
                                [--device cuda|cpu]

Each check is one line (a row) of a markdown summary, written to FILE.md (default
results/measured-here/gpu-check-<gpu>.md), the runs' records beside it (FILE.jsonl):

- environment: the GPU, its compute capability against the torch build's code, torch, CUDA, NCCL,
  fairscale and megatron-core as found, the peak the run's MFU will use;
- one-rank: every system at one rank with --verify, in fp32, bf16 and fp16 (``--precision``);
- shared: several ranks sharing the one GPU over NCCL, each on a virtual node of its own (its own host
  name, and NCCL_HOSTID, so NCCL sees separate hosts), through the cluster mode over ssh: --verify of
  ours P-2, ours P-2 D-2 sharded_ps, torch_pipe 1f1b P-2, torch_pipe zbv P-2, megatron T-2, megatron P-2;
- shaped: torch_pipe 1f1b P-2 over NCCL unshaped and under d10-1g (shaped on the nodes' interface,
  NCCL held to it): the step must slow by at least the delays its schedule pays (fill and drain,
  2(P − 1) one-way delays);
- figures: the closing barrier of those two runs (under d10-1g the last rank to arrive waits one
  delay: at least that, or the barrier does not block the host), and the memory of the shared runs
  per GPU (allocated and reserved, reserved ≥ allocated > 0) beside each rank's CPU RSS.

The summary is written after every check, so a check script stopped part-way (a device lease's end)
keeps the rows it had. Each run is bounded by ``--run-timeout`` (a hang costs that, not the lease),
under which NCCL's watchdog ends a hung run first and its row names the operation that never came
(``contract.groups.op_timeout``). ``--jobs J`` runs J one-rank checks at once (on one GPU their step
times then share it: the rows say so; --verify is what they check).

Without a GPU it says so and exits 0 once its arguments are judged (``--device cpu`` runs the same
checks on CPU over gloo instead: a rehearsal of this script, which proves nothing of CUDA). The
virtual nodes need root and sshd; without them those checks say "not run". Exit status: 0 every check
that ran passed, 1 one failed, 2 bad arguments.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from contract.cli import POSITIVE_INT, number
from contract import ConfigError
from contract.config import PRECISIONS
from runners.request import check_writable

REPO = Path(__file__).resolve().parent.parent
CHECKS = ("environment", "one-rank", "shared", "shaped", "figures")
ONE_RANK = {  # system -> its arguments at one rank
    "torch_pipe": ["--system", "torch_pipe"],
    "fairscale_fsdp": ["--system", "fairscale_fsdp"],
    "megatron": ["--system", "megatron"],
    "ours": ["--system", "ours"],
}
SHARED = {  # label -> arguments; each rank on a virtual node of its own, all on the one GPU
    "ours P-2": ["--system", "ours", "--pp", "2"],
    "ours P-2 D-2 sharded_ps": ["--system", "ours", "--pp", "2", "--dp", "2", "--dp-mode", "sharded_ps"],
    "ours P-2 bf16": ["--system", "ours", "--pp", "2", "--precision", "bf16"],
    "ours P-2 fp16": ["--system", "ours", "--pp", "2", "--precision", "fp16"],
    "torch_pipe 1f1b P-2": ["--system", "torch_pipe", "--pp", "2", "--schedule", "1f1b"],
    "torch_pipe zbv P-2": ["--system", "torch_pipe", "--pp", "2", "--schedule", "zbv"],
    "megatron T-2": ["--system", "megatron", "--tp", "2"],
    "megatron P-2": ["--system", "megatron", "--pp", "2"],
}
SHAPED = ("torch_pipe 1f1b P-2", "d10-1g", 2)  # label (of SHARED), profile, pipeline stages P
NODES = 4  # virtual nodes: the most ranks of a SHARED run (ours P-2 D-2), one on each


@dataclass(frozen=True)
class Line:
    """One check's row: passed True / False, or None where it did not run (``detail`` says why)."""

    check: str
    passed: bool | None
    detail: str

    def row(self) -> str:
        verdict = {True: "PASS", False: "**FAIL**", None: "not run"}[self.passed]
        return f"| {self.check} | {verdict} | {self.detail.replace('|', '/')} |"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="the summary (markdown; default results/measured-here/"
                                                "gpu-check-<gpu>.md), the records beside it (.jsonl)")
    ap.add_argument("--only", action="append", choices=CHECKS, default=[], help="only this check (repeatable)")
    ap.add_argument("--case", action="append", choices=list(SHARED), default=[],
                    help="of the shared check, only this run (repeatable; default all)")
    ap.add_argument("--steps", type=POSITIVE_INT, default=3, help="measured steps of each run (default 3)")
    ap.add_argument("--run-timeout", type=number(float, 30), default=240.0,
                    help="seconds each run may take before it is stopped and its row fails (default 240)")
    ap.add_argument("--jobs", type=POSITIVE_INT, default=1, help="one-rank checks run at once (default 1)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: the same checks on CPU over gloo, a rehearsal of this script (default cuda)")
    return ap


def slug(name: str) -> str:
    """A GPU's name as a file name part: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


@dataclass(frozen=True)
class Settings:
    device: str
    steps: int
    run_timeout: float

    def args(self, steps: int | None = None) -> list[str]:
        """Every run's common arguments."""
        return ["--model", "tiny", "--batch-size", "2", "--micro-batch-size", "1", "--steps", str(steps or self.steps),
                "--warmup", "1", "--timeout", f"{self.run_timeout:g}", "--device", self.device]


def verify_line(check: str, rec: dict | None, tail: str) -> Line:
    """A --verify run's row, from its record (the tail of its output where it wrote none)."""
    if rec is None:
        last = [l for l in tail.splitlines() if l.strip()]
        return Line(check, False, f"no record: {last[-1].strip() if last else 'no output'}"[:300])
    v = rec.get("verify") or {}
    if rec.get("status") != "ok" or not v:
        return Line(check, False, f"{rec.get('status')}: {(rec.get('error') or v.get('reason') or '')[:300]}")
    step = rec.get("median_step_time")
    return Line(check, bool(v.get("passed")),
                f"verify ({v.get('tolerance')}): loss diff {v.get('max_abs_loss_diff'):.2e}, max rel grad diff "
                f"{v.get('max_rel_grad_diff'):.2e} over {v.get('n_grads')} grads; median step "
                f"{step * 1e3:.1f} ms on {rec.get('environment', {}).get('device_name')}"
                + (f" ({v['reason']})" if v.get("reason") else ""))


def environment_line(device: str) -> Line:
    import torch

    from runners.devices import judge_gpus, local_gpus
    from workload.flops import gpu_model

    versions = []
    for name in ("fairscale", "megatron-core"):
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} missing")
    found = f"torch {torch.__version__}, Python {platform.python_version()}, {', '.join(versions)}"
    if device == "cpu":
        return Line("environment", "missing" not in found, f"CPU over gloo (a rehearsal); {found}")
    version = torch.cuda.nccl.version()  # a tuple, or an int in older torch
    nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    gpus = local_gpus()
    try:
        hardware = judge_gpus("cuda", gpus, 1)
    except ConfigError as e:
        return Line("environment", False, f"{e}; {found}")
    cap = gpus.capabilities[0]
    model = gpu_model(gpus.names[0])
    peak = f"peak table: {model}" if model else "not in the peak table: a measured matmul peak"
    return Line("environment", "missing" not in found,
                f"{hardware.removeprefix('cuda:')} (sm_{cap[0]}{cap[1]}, {gpus.count} GPU(s)), built code "
                f"{' '.join(gpus.arch_list)}; CUDA {torch.version.cuda}, NCCL {nccl}; {found}; {peak}")


def one_rank_lines(settings: Settings, jobs: int, records: Path, report: "Report") -> None:
    """Every system at one rank, in each precision, ``jobs`` runs at once; each row added as its run ends."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from runners.invoke import run_command
    from runners.record import append_line

    def check(system: str, precision: str) -> tuple[Line, float]:
        started = time.monotonic()
        inv = run_command([*ONE_RANK[system], *settings.args(), "--precision", precision, "--verify"],
                          timeout=settings.run_timeout + 90)  # its own --timeout stops it first
        if inv.record is not None:
            append_line(records, json.dumps(inv.record))
        return verify_line(f"one rank: {system} {precision}", inv.record, inv.output), time.monotonic() - started

    shared = f", {jobs} runs at once on one device" if jobs > 1 else ""
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        futures = [pool.submit(check, system, precision) for precision in PRECISIONS for system in ONE_RANK]
        for future in as_completed(futures):
            line, took = future.result()
            report.add(line, f"({took:.0f} s{shared})")
    finally:  # on an interruption: no new runs; those running are stopped with this process (runners.invoke)
        pool.shutdown(wait=False, cancel_futures=True)


class Nodes:
    """Virtual nodes (tools.nodes) and a cluster executor over them, or why there are none."""

    def __init__(self, count: int, log) -> None:
        self.count, self.log = count, log
        self.vn = None
        self.executor = None
        self.why: str | None = None

    def __enter__(self) -> Nodes:
        from tools.nodes import NodesError, VirtualNodes
        from runners.sweep.cluster import ClusterExecutor, parse_hostfile

        if os.geteuid() != 0:
            self.why = "needs root (virtual nodes: network namespaces and their sshd)"
            return self
        directory = tempfile.mkdtemp(prefix="pipebench-gpucheck-")
        try:
            self.vn = VirtualNodes(self.count, directory, log=self.log)
            self.vn.__enter__()  # on a failure to start, it has taken down what it started
        except (NodesError, FileNotFoundError, RuntimeError, OSError, subprocess.SubprocessError) as e:
            self.vn = None
            self.why = f"the virtual nodes did not come up: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            return self
        self.executor = ClusterExecutor(parse_hostfile(self.vn.hostfile), iface="eth0",
                                        ssh_config=str(self.vn.ssh_config), log=self.log)
        return self

    def __exit__(self, *exc) -> None:
        if self.vn is not None:
            self.vn.__exit__(*exc)

    def run(self, args: list[str], network: str, records: Path) -> tuple[dict | None, str]:
        """One run across the nodes (one rank on each it needs): its record and output tail."""
        from runners.sweep.hostfile import DoesNotFit
        from runners.sweep.plan import plan_run

        planned = plan_run([*args, "--network", network], "gpu-check", network)
        if not planned.valid:
            return None, planned.error or "invalid"
        before = records.read_text().count("\n") if records.exists() else 0
        try:
            _, tail = self.executor(planned, records)
        except DoesNotFit as e:  # recorded as unfit by the executor
            return None, str(e)
        lines = [l for l in records.read_text().splitlines() if l.strip()] if records.exists() else []
        return (json.loads(lines[-1]) if len(lines) > before else None), tail


def shared_lines(nodes: Nodes, settings: Settings, records: Path, report: "Report",
                 cases: Sequence[str] = ()) -> dict[str, dict]:
    recs = {}
    for label, args in SHARED.items():
        if cases and label not in cases:
            continue
        check = f"shared GPU: {label}"
        if nodes.executor is None:
            report.add(Line(check, None, nodes.why or "no nodes"))
            continue
        started = time.monotonic()
        rec, tail = nodes.run([*args, *settings.args(), "--verify"], "none", records)
        if rec is not None:
            recs[label] = rec
        line = verify_line(check, rec, tail)
        if rec is not None and line.passed is not None:
            hosts = rec.get("environment", {}).get("hostnames") or []
            line = Line(check, line.passed, f"{line.detail}; {len(hosts)} hosts {', '.join(hosts)}, backend "
                                             f"{rec.get('environment', {}).get('backend')}")
        report.add(line, f"({time.monotonic() - started:.0f} s)")
    return recs


def shaped_line(nodes: Nodes, settings: Settings, records: Path) -> tuple[Line, dict[str, dict]]:
    from network_emulation.profiles import parse_profile

    label, profile, stages = SHAPED
    check = f"shaped link: {label} under {profile}"
    if nodes.executor is None:
        return Line(check, None, nodes.why or "no nodes"), {}
    delay = parse_profile(profile).link_spec.delay_ms
    recs = {}
    for network in ("none", profile):
        rec, tail = nodes.run([*SHARED[label], *settings.args(max(settings.steps, 5))], network, records)
        if rec is None or rec.get("status") != "ok":
            why = rec.get("error") if rec else ([l for l in tail.splitlines() if l.strip()] or ["no output"])[-1]
            return Line(check, False, f"the {network} run: {str(why)[:300]}"), recs
        recs[network] = rec
    base, shaped = recs["none"]["median_step_time"], recs[profile]["median_step_time"]
    paid = (shaped - base) / (delay / 1e3)
    floor = 2 * (stages - 1)
    nccl = recs[profile].get("environment", {}).get("cluster", {}).get("nccl_env", {})
    line = Line(check, paid >= floor,
                f"median step {base * 1e3:.1f} -> {shaped * 1e3:.1f} ms: +{(shaped - base) * 1e3:.1f} ms = {paid:.1f} "
                f"one-way delays of {delay:g} ms, at least {floor} (fill and drain) expected; "
                f"backend {recs[profile].get('environment', {}).get('backend')}, "
                f"{' '.join(f'{k}={v}' for k, v in nccl.items())}")
    return line, recs


def barrier_line(shaped: dict[str, dict]) -> Line:
    """The step's closing barrier on the first rank to reach it: under the shaped link it waits for the
    last rank's signal, a one-way delay at least, where the barrier blocks the host (a barrier that
    only queues its wait on the GPU returns at once, and the wait moves into the next step)."""
    label, profile, _ = SHAPED
    check = f"barrier: {label}"
    if len(shaped) < 2:
        return Line(check, None, "no shaped pair of runs")
    from network_emulation.profiles import parse_profile

    delay = parse_profile(profile).link_spec.delay_ms / 1e3
    first = [shaped[n].get("barrier_time_first") for n in ("none", profile)]
    last = [shaped[n].get("barrier_time") for n in ("none", profile)]
    if None in first or None in last:
        return Line(check, False, "the records have no barrier times")
    return Line(check, first[1] >= 0.8 * delay,
                f"closing barrier on the first rank to reach it {first[0] * 1e3:.2f} ms unshaped, "
                f"{first[1] * 1e3:.2f} ms under {profile} (at least 0.8 of one {delay * 1e3:g} ms delay expected: the "
                f"barrier blocks the host); on the last rank {last[0] * 1e3:.2f} and {last[1] * 1e3:.2f} ms")


def memory_line(recs: dict[str, dict]) -> Line:
    check = "memory: runs over the virtual nodes"
    if not recs:
        return Line(check, None, "no records of runs over the virtual nodes")
    ok, parts = True, []
    mb = 2 ** 20
    for label, rec in recs.items():
        alloc, reserved, rss = (rec.get("peak_memory_bytes") or [], rec.get("peak_reserved_bytes") or [],
                                rec.get("cpu_rss_bytes") or [])
        gpu = rec.get("environment", {}).get("device_kind") == "cuda"
        if gpu:
            ok &= len(alloc) == len(reserved) > 0 and all(r >= a > 0 for a, r in zip(alloc, reserved))
            parts.append(f"{label}: allocated {'/'.join(f'{a / mb:.0f}' for a in alloc)} MB, reserved "
                         f"{'/'.join(f'{r / mb:.0f}' for r in reserved)} MB, CPU RSS "
                         f"{'/'.join(f'{r / mb:.0f}' for r in rss)} MB")
        else:
            ok &= len(rss) > 0 and all(r > 0 for r in rss)
            parts.append(f"{label}: CPU RSS {'/'.join(f'{r / mb:.0f}' for r in rss)} MB (no GPU)")
    return Line(check, ok, "per GPU, reserved >= allocated > 0 expected; " + "; ".join(parts))


def _git(*args: str) -> str:
    """git's answer in the repository, or "" where there is none (a copy of the tree without .git, or no
    git on the machine: a GPU host's copy, say); the summary then names the code by PIPEBENCH_COMMIT."""
    try:
        p = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return p.stdout.strip() if p.returncode == 0 else ""


def summary(lines: Sequence[Line], title: str, argv: Sequence[str], elapsed: float, state: str = "") -> str:
    """The markdown summary; ``state`` says where a check script that has not ended stands."""
    commit = _git("rev-parse", "--short", "HEAD") or os.environ.get("PIPEBENCH_COMMIT") or "?"
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    counts = {v: sum(1 for l in lines if l.passed is v) for v in (True, False, None)}
    return "\n".join([
        f"# gpu_check: {title}", "",
        f"`scripts/gpu_check.sh {' '.join(argv)}` at {commit}{' (with local changes)' if dirty else ''}, "
        f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {elapsed / 60:.1f} min: {counts[True]} passed, "
        f"{counts[False]} failed, {counts[None]} not run{f' ({state})' if state else ''}.", "",
        "| check | result | detail |", "| --- | --- | --- |", *(l.row() for l in lines), ""])


class Report:
    """The rows so far, printed as they come and written to ``out`` after each (nothing is lost when
    the script is stopped part-way); ``finish`` writes the final summary."""

    def __init__(self, out: Path, title: str, argv: Sequence[str]):
        self.out, self.title, self.argv = out, title, list(argv)
        self.lines: list[Line] = []
        self.started = time.monotonic()

    def add(self, line: Line, note: str = "") -> None:
        self.lines.append(line)
        print(f"{line.row()}{f' {note}' if note else ''}", flush=True)
        self._write("in progress")

    def finish(self, state: str = "") -> None:
        self._write(state)

    def _write(self, state: str) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(summary(self.lines, self.title, self.argv, time.monotonic() - self.started, state))
        tmp.replace(self.out)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.out is not None:
        try:
            check_writable(args.out, "--out")
        except ConfigError as e:
            ap.error(str(e))
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no GPU here (torch.cuda.is_available() is False): nothing checked, nothing written")
        return 0
    from network_emulation.signals import Terminated, signals_raise
    from runners.devices import local_gpus

    only = set(args.only or CHECKS)
    try:
        name = local_gpus().names[0] if args.device == "cuda" else "cpu"  # (no CUDA context held here)
    except ConfigError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 1
    out = Path(args.out or REPO / "results" / "measured-here" / f"gpu-check-{slug(name)}.md")
    records = out.with_suffix(".jsonl")
    records.unlink(missing_ok=True)
    settings = Settings(args.device, args.steps, args.run_timeout)
    title = name if args.device == "cuda" else "CPU over gloo (a rehearsal of the script, not a GPU check)"
    report = Report(out, title, argv)
    try:
        with signals_raise():
            if "environment" in only:
                report.add(environment_line(args.device))
            if "one-rank" in only:
                one_rank_lines(settings, args.jobs, records, report)
            if only & {"shared", "shaped", "figures"}:
                with Nodes(NODES, sys.stdout) as nodes:
                    shared_recs, shaped_recs = {}, {}
                    if "shared" in only:
                        shared_recs = shared_lines(nodes, settings, records, report, args.case)
                    if only & {"shaped", "figures"}:  # the figures are read off these runs (and the shared ones)
                        got_line, shaped_recs = shaped_line(nodes, settings, records)
                        if "shaped" in only:
                            report.add(got_line)
                    if "figures" in only:
                        memory_of = shared_recs or {f"{SHAPED[0]} {k}": v for k, v in shaped_recs.items()}
                        report.add(barrier_line(shaped_recs))
                        report.add(memory_line(memory_of))
    except (KeyboardInterrupt, Terminated):
        report.finish(f"interrupted after {len(report.lines)} checks")
        print(f"gpu_check: interrupted; the rows so far are in {out}", file=sys.stderr, flush=True)
        os._exit(130)  # runs still going in the pool's threads are stopped with this process (runners.invoke)
    report.finish()
    print(f"gpu_check: {out} ({records.name} beside it)", flush=True)
    return 1 if any(l.passed is False for l in report.lines) else 0


if __name__ == "__main__":
    sys.exit(main())
