"""How far each system's --verify lands from the reference per precision policy, over many seeds.

The distribution that ``runners.tolerance`` derives its tolerances from.

Every case (a system and layout on the tiny test model: 4 layers, hidden 64, 4 heads, sequence 32,
vocabulary 128; batch 4 per pipeline, micro-batch 1) runs the real run command with ``--verify`` once
per (policy, seed, steps); each run appends one line to ``--keep`` (default
``results/measured-here/verify-spread.jsonl``): the case, its policy class (``runners.tolerance``),
the seed, the steps, and the record's verification (largest loss difference, largest gradient
difference, absolute and as a fraction of each parameter's largest reference gradient). A run
already there is not run again, so the measurement goes in chunks (``--budget`` seconds each, e.g.
under the shared CPU lock) and resumes where it stopped. The reference of a (seed, policy, global
batch) is trained once and shared by every case (``runners.reference_cache``).

    python -m tools.verify_spread run --precision bf16 fp16 --seeds 0-23 --budget 240
    python -m tools.verify_spread run --precision bf16 --cases "megatron P-2" --steps 1 2 4 8 --seeds 0-3
    python -m tools.verify_spread summary           (the tables, and the tolerance each policy's rule gives)

``summary`` prints, per policy class and case, the runs, the median and the maximum of each
difference, and the tolerance that ``runners.tolerance.derive`` gives over the class's runs at the
tests' steps (2), beside the one in force; ``--write FILE`` also writes them as markdown.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from runners.invoke import run_command
from runners.tolerance import DERIVED_AT_STEPS, DERIVED_TOKENS, derivation_runs, derive, policy_class, tolerance_table

REPO = Path(__file__).resolve().parent.parent
KEEP = REPO / "results" / "measured-here" / "verify-spread.jsonl"
# the models it runs: the tests' (tests.conftest.TINY), and the tiny model itself (hidden 128, sequence 128)
MODELS = {"test": ("--model", "tiny", "--num-layers", "4", "--hidden-size", "64", "--num-heads", "4",
                   "--seq-length", "32", "--vocab-size", "128"),
          "tiny": ("--model", "tiny")}
BATCH = ("--batch-size", "4", "--micro-batch-size", "1")
CASES: dict[str, tuple[str, ...]] = {
    "torch_pipe 1f1b P-2": ("--system", "torch_pipe", "--pp", "2", "--schedule", "1f1b"),
    "torch_pipe zbv P-2": ("--system", "torch_pipe", "--pp", "2", "--schedule", "zbv"),
    "torch_pipe 1f1b P-2 D-2": ("--system", "torch_pipe", "--pp", "2", "--dp", "2", "--schedule", "1f1b"),
    "fairscale_fsdp P-2": ("--system", "fairscale_fsdp", "--pp", "2"),
    "fairscale_fsdp P-2 D-2": ("--system", "fairscale_fsdp", "--pp", "2", "--dp", "2"),
    "megatron P-2": ("--system", "megatron", "--pp", "2"),
    "megatron T-2": ("--system", "megatron", "--tp", "2"),
    "megatron D-2": ("--system", "megatron", "--dp", "2"),
    "ours P-2 K-2": ("--system", "ours", "--pp", "2", "--n-slices", "2"),
    "ours P-2 D-2 sharded_ps": ("--system", "ours", "--pp", "2", "--dp", "2", "--n-slices", "2",
                                "--dp-mode", "sharded_ps"),
}
HALF_WEIGHTS = ("megatron",)  # the systems whose spec keeps half weights (contract.SystemSpec.half_weights)


def seeds(text: str) -> list[int]:
    """'0-23' or '0,3,5' or '7'."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def case_class(case: str, precision: str) -> str:
    return policy_class(precision, half_weights=case.split()[0] in HALF_WEIGHTS)


def load(path: Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []


def run(opts: argparse.Namespace) -> int:
    keep = Path(opts.keep)
    keep.parent.mkdir(parents=True, exist_ok=True)
    shape = " ".join([opts.model, *opts.extra])
    done = {(r["case"], r["shape"], r["precision"], r["seed"], r["steps"]) for r in load(keep)}
    todo = [(case, precision, seed, steps) for seed in opts.seeds for steps in opts.steps
            for precision in opts.precision for case in opts.cases
            if (case, shape, precision, seed, steps) not in done]
    began = time.monotonic()
    print(f"verify-spread: {len(todo)} runs to go ({len(done)} kept in {keep})", flush=True)
    for n, (case, precision, seed, steps) in enumerate(todo):
        if opts.budget is not None and time.monotonic() - began > opts.budget:
            print(f"verify-spread: budget of {opts.budget:g} s spent, {len(todo) - n} runs left; run again to go on")
            return 0
        args = [*CASES[case], *MODELS[opts.model], *BATCH, "--precision", precision, "--seed", str(seed),
                "--steps", str(steps), "--warmup", "0", "--verify", "--timeout", str(opts.timeout), *opts.extra]
        inv = run_command(args, timeout=opts.timeout + 60)
        rec = inv.record or {}
        v = rec.get("verify") or {}
        config = rec.get("config") or {}
        tokens = config["micro_batch_size"] * config["model"]["seq_len"] if config else None
        line = {"case": case, "shape": shape, "tokens": tokens, "precision": precision,
                "class": case_class(case, precision), "seed": seed, "steps": steps,
                "status": rec.get("status", f"no record (exit {inv.returncode})"),
                **{k: v.get(k) for k in ("max_abs_loss_diff", "max_abs_grad_diff", "max_rel_grad_diff", "passed",
                                         "tolerance")}}
        if rec.get("status") != "ok" or not v:
            line["error"] = rec.get("error") or inv.last_line
        with keep.open("a") as f:
            f.write(json.dumps(line) + "\n")
        print(f"[{n + 1}/{len(todo)}] {case} {precision} seed {seed} steps {steps}: {line['status']} "
              f"rel {line['max_rel_grad_diff']} loss {line['max_abs_loss_diff']} "
              f"{'PASS' if line.get('passed') else 'FAIL'}", flush=True)
    return 0


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def summary_lines(rows: list[dict]) -> list[str]:
    """Markdown: per policy class, case, model shape and steps, the spread; the runs whose verification
    failed or did not run; then per class the tolerance the rule gives against the one in force."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("max_rel_grad_diff") is not None]
    out = ["| policy | case | shape (tokens per micro-batch) | steps | runs | rel grad diff median | max | "
           "abs grad diff max | loss diff median | max |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    groups: dict[tuple, list[dict]] = {}
    for r in ok:
        groups.setdefault((r["class"], r["case"], r["tokens"], r["shape"], r["steps"]), []).append(r)
    for (cls, case, tokens, shape, steps), rs in sorted(groups.items()):
        rel = [r["max_rel_grad_diff"] for r in rs]
        loss = [r["max_abs_loss_diff"] for r in rs]
        out.append(f"| {cls} | {case} | {shape} ({tokens}) | {steps} | {len(rs)} | {_fmt(statistics.median(rel))} | "
                   f"{_fmt(max(rel))} | {_fmt(max(r['max_abs_grad_diff'] for r in rs))} | "
                   f"{_fmt(statistics.median(loss))} | {_fmt(max(loss))} |")
    bad = [r for r in rows if r not in ok or not r.get("passed")]
    if bad:
        out += ["", "Runs whose verification failed or did not run:", ""]
        out += [f"- {r['case']} {r['precision']} {r['shape']} seed {r['seed']} steps {r['steps']}: {r['status']}, "
                f"rel {_fmt(r.get('max_rel_grad_diff'))}, loss {_fmt(r.get('max_abs_loss_diff'))}, judged by "
                f"{r.get('tolerance')} {r.get('error', '')}".rstrip() for r in bad]
    out += ["", f"Each policy's tolerance by the rule (``runners.tolerance.derive``) over its runs on the tests' "
                f"model ({DERIVED_TOKENS} tokens per micro-batch) at {DERIVED_AT_STEPS} steps:", "",
            "| policy | runs | rel grad diff max | abs grad diff max | loss diff max | derived | in force |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    table = tolerance_table()
    for cls in sorted({r["class"] for r in ok}):
        rs = derivation_runs(cls, ok)
        if not rs:
            continue
        force = table.get(cls)
        out.append(f"| {cls} | {len(rs)} | {_fmt(max(r['max_rel_grad_diff'] for r in rs))} | "
                   f"{_fmt(max(r['max_abs_grad_diff'] for r in rs))} | "
                   f"{_fmt(max(r['max_abs_loss_diff'] for r in rs))} | "
                   f"{derive(cls, rs).describe()} | {force.describe() if force else '-'} |")
    return out


def summary(opts: argparse.Namespace) -> int:
    lines = summary_lines(load(Path(opts.keep)))
    print("\n".join(lines))
    if opts.write:
        Path(opts.write).write_text("\n".join(lines) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.verify_spread", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the cases' --verify at many seeds (resumable)")
    r.add_argument("--precision", nargs="+", default=["fp32", "bf16", "fp16"], choices=["fp32", "bf16", "fp16"])
    r.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES), metavar="CASE")
    r.add_argument("--seeds", type=seeds, default=seeds("0-23"), help="e.g. 0-23 or 0,5,9")
    r.add_argument("--model", default="test", choices=list(MODELS),
                   help="test: the tests' model (4 layers, hidden 64, sequence 32); tiny: hidden 128, sequence 128")
    r.add_argument("--steps", type=int, nargs="+", default=[DERIVED_AT_STEPS], help="optimizer steps per run")
    r.add_argument("--budget", type=float, default=None, help="stop starting runs after this many seconds")
    r.add_argument("--timeout", type=float, default=300.0)
    r.add_argument("--keep", default=str(KEEP))
    r.add_argument("extra", nargs="*", help="after --: more run-command flags (e.g. --seq-length 128)")
    s = sub.add_parser("summary", help="the spread per policy and case, and the tolerances it gives")
    s.add_argument("--keep", default=str(KEEP))
    s.add_argument("--write", default=None, help="also write the tables (markdown) to this file")
    opts = p.parse_args(argv)
    return run(opts) if opts.command == "run" else summary(opts)


if __name__ == "__main__":
    sys.exit(main())
