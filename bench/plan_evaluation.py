"""Predicted against measured step time: run ``--system ours`` with uniform slicings and the optimal one.

    python -m bench plan-evaluation --model cpu-small --pp 2 --batch-size 1 --micro-batch-size 1

Each slicing is run through the run command (a subprocess, records to a JSON-lines file); its
measured median step time is compared with the latency model's prediction of the whole step (TeraPipe's
formula over this CPU's compute model, ``ours.plan``, plus the head, the embeddings and the optimizer).

Two predictions are reported:
- ``raw``: the model as it is (pipeline formula + head + embeddings + optimizer);
- ``loo``: plus a per-step constant calibrated on the *other* runs (leave-one-out median of their
  measured - raw residuals), so that no run's own measurement enters its prediction.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tabulate import tabulate

from ours import uniform_slices
from ours.plan.auto import cache_key, profile_path
from contract.links import Link
from ours.plan.planner import pipeline_time, plan
from runners.invoke import run_command
from workload.compute import ComputeModel, CpuCompute, stage_params
from workload.configs import MODEL_CONFIGS, get_model_config
from contract.estimate import estimate
from contract.cli import NONNEGATIVE_INT, POSITIVE_INT, cannot_create_in


@dataclass
class Case:
    name: str
    slices: tuple[int, ...]


def cases(seq_len: int, ks: list[int], optimal: tuple[int, ...]) -> list[Case]:
    out = [Case(f"uniform K={k}", uniform_slices(seq_len, k)) for k in ks if k <= seq_len]
    out.append(Case(f"optimal ({len(optimal)} slices)", tuple(optimal)))
    return out


def run_case(model: str, case: Case, *, pp: int, batch_size: int, micro: int, steps: int, warmup: int,
             out: Path, extra: list[str], timeout: float) -> dict:
    args = ["--system", "ours", "--model", model, "--pp", str(pp), "--batch-size", str(batch_size),
            "--micro-batch-size", str(micro), "--steps", str(steps), "--warmup", str(warmup), *extra]
    args += ["--n-slices", "1"] if len(case.slices) == 1 else ["--slices", ",".join(map(str, case.slices))]
    inv = run_command(args, out=out, timeout=timeout)
    rec = inv.record
    if rec is None:
        return dict(status="error", error=f"exit {inv.returncode}: {inv.output.strip()[-500:]}", median_step_time=None)
    return dict(status=rec.get("status"), error=rec.get("error"), median_step_time=rec.get("median_step_time"),
                step_times=rec.get("step_times"))


def step_parts(cm: ComputeModel, cfg, slices, micro: int, batch_size: int, pp: int, link: Link | None) -> dict:
    """The whole step as the formula sees it: the pipeline, the last stage's head and loss, the first
    stage's embeddings and its optimizer step (the first stage finishes last)."""
    tokens = batch_size * cfg.seq_len
    pipe = pipeline_time(cm, cfg, slices, b=micro, batch_size=batch_size, n_stages=pp, link=link)
    head = cm.head_forward(tokens) + cm.head_backward_input(tokens) + cm.head_wgrad(tokens)
    embed = cm.embed(tokens)
    opt = cm.optimizer(stage_params(cfg, cfg.n_layer // pp, True, pp == 1))
    return dict(total=pipe + head + embed + opt, pipeline=pipe, head=head, embed=embed, optimizer=opt)


def evaluate(cm: ComputeModel, *, model: str, n_layer: int, seq_len: int, pp: int, batch_size: int, micro: int,
             ks: list[int], steps: int, warmup: int, out_dir: Path, granularity: int = 8, rounds: int = 1,
             extra: list[str] | None = None, timeout: float = 1800, log=print, link: Link | None = None) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    runs_file = out_dir / "runs.jsonl"
    cfg = get_model_config(model).with_overrides(n_layer=n_layer, seq_len=seq_len)
    best = plan(cm, cfg, n_stages=pp, batch_size=batch_size, granularity=granularity, batch_slices=[micro], link=link)
    log(f"optimal: {best.summary()}")
    cs = cases(seq_len, ks, best.slices)
    measured: dict[str, list[float]] = {c.name: [] for c in cs}
    all_steps: dict[str, list[float]] = {c.name: [] for c in cs}
    status: dict[str, str] = {}
    for r in range(rounds):
        order = cs if r % 2 == 0 else list(reversed(cs))  # alternate to spread drifting load
        for c in order:
            t = time.perf_counter()
            res = run_case(model, c, pp=pp, batch_size=batch_size, micro=micro, steps=steps, warmup=warmup,
                           out=runs_file, extra=extra or [], timeout=timeout)
            status[c.name] = res["status"] if res["status"] != "ok" or c.name not in status else status[c.name]
            if res["status"] == "ok":
                measured[c.name].append(res["median_step_time"])
                all_steps[c.name] += list(res.get("step_times") or [])
            log(f"  round {r + 1} {c.name}: {res['status']} median {res['median_step_time']} "
                f"({time.perf_counter() - t:.0f} s){'' if res['status'] == 'ok' else ' ' + str(res['error'])[:300]}")
    rows = []
    for c in cs:
        pred = step_parts(cm, cfg, c.slices, micro, batch_size, pp, link)
        m = estimate(measured[c.name]).median if measured[c.name] else None  # the report's statistics
        rows.append(dict(name=c.name, n_slices=len(c.slices), slices=list(c.slices), status=status.get(c.name),
                         predicted_pipeline=pred["pipeline"], predicted_raw=pred["total"], parts=pred, measured=m,
                         measured_all=measured[c.name],
                         measured_min=min(all_steps[c.name]) if all_steps[c.name] else None))
    summary = calibrate(rows)
    result = dict(kind="ours.plan.evaluation", model=model, n_layer=n_layer, seq_len=seq_len, pp=pp,
                  batch_size=batch_size, micro_batch_size=micro, steps=steps, warmup=warmup, rounds=rounds,
                  granularity=granularity, optimal=best.to_dict(), rows=rows, summary=summary)
    (out_dir / "evaluation.json").write_text(json.dumps(result, indent=1))
    (out_dir / "evaluation.md").write_text(markdown(result))
    return result


def calibrate(rows: list[dict]) -> dict:
    """Prediction errors of each row (in place) and their summary: raw, and with a per-step
    constant or a scale calibrated leave-one-out (on the other rows' measurements only)."""
    ok = [r for r in rows if r.get("measured") is not None]
    for r in ok:
        others = [o for o in ok if o is not r]
        const = statistics.median(o["measured"] - o["predicted_raw"] for o in others) if others else 0.0
        scale = statistics.median(o["measured"] / o["predicted_raw"] for o in others) if others else 1.0
        r["loo_constant"], r["loo_scale"] = const, scale
        r["predicted_loo"] = r["predicted_raw"] + const
        r["predicted_loo_scale"] = r["predicted_raw"] * scale
        for key, pred in (("error_raw", "predicted_raw"), ("error_loo", "predicted_loo"),
                          ("error_loo_scale", "predicted_loo_scale")):
            r[key] = (r[pred] - r["measured"]) / r["measured"]
        if r.get("measured_min"):
            r["error_raw_min"] = (r["predicted_raw"] - r["measured_min"]) / r["measured_min"]
    def med(key):
        return statistics.median(abs(r[key]) for r in ok) if ok else None

    return dict(
        median_abs_error_raw=med("error_raw"), median_abs_error_loo=med("error_loo"),
        median_abs_error_loo_scale=med("error_loo_scale"),
        median_abs_error_raw_vs_min=(statistics.median(abs(r["error_raw_min"]) for r in ok if "error_raw_min" in r)
                                     if any("error_raw_min" in r for r in ok) else None),
        constant_all=statistics.median(r["measured"] - r["predicted_raw"] for r in ok) if ok else None,
        scale_all=statistics.median(r["measured"] / r["predicted_raw"] for r in ok) if ok else None,
        best_measured=min(ok, key=lambda r: r["measured"])["name"] if ok else None,
        best_predicted=min(rows, key=lambda r: r["predicted_raw"])["name"],
    )


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def _pct(x) -> str:
    return "-" if x is None else f"{x * 100:+.1f} %"


def _abs(x) -> str:
    return "-" if x is None else f"{x * 100:.1f} %"


def markdown(res: dict) -> str:
    s = res["summary"]
    lines = [
        f"# Predicted vs measured step time: ours, {res['model']}, P={res['pp']}, B={res['batch_size']}, "
        f"b={res['micro_batch_size']}",
        "",
        f"{res['steps']} measured steps after {res['warmup']} warm-up, {res['rounds']} round(s) (alternating order); "
        f"measured median = median over rounds of each run's median step; "
        f"slicing granularity {res['granularity']}.",
        "",
    ]
    rows = []
    for r in res["rows"]:
        sl = ",".join(map(str, r["slices"]))
        rows.append([r["name"], sl if len(sl) <= 60 else sl[:57] + "...", _ms(r["predicted_pipeline"]),
                     _ms(r["predicted_raw"]), _ms(r["measured"]), _ms(r.get("measured_min")), _pct(r.get("error_raw")),
                     _pct(r.get("error_loo")), _pct(r.get("error_loo_scale")), _pct(r.get("error_raw_min"))])
    lines.append(tabulate(rows, headers=["slicing", "slices", "predicted pipeline (ms)", "predicted step, raw (ms)",
                                         "measured median (ms)", "measured min (ms)", "error raw",
                                         "error, LOO constant", "error, LOO scale", "error raw vs min"],
                          tablefmt="github", disable_numparse=True))
    lines += [
        "",
        f"Median absolute prediction error: raw {_abs(s['median_abs_error_raw'])}; with a per-step constant "
        f"calibrated leave-one-out {_abs(s['median_abs_error_loo'])}; with a scale calibrated leave-one-out "
        f"{_abs(s.get('median_abs_error_loo_scale'))}; raw against the fastest measured step "
        f"{_abs(s.get('median_abs_error_raw_vs_min'))}. Fastest measured: {s['best_measured']}; fastest predicted: "
        f"{s['best_predicted']}.",
        "",
    ]
    return "\n".join(lines)


def _counts(text: str) -> list[int]:
    """--ks: slice counts, comma-separated, each a whole number >= 1."""
    try:
        return [POSITIVE_INT(x) for x in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"takes whole numbers >= 1, comma-separated, got {text!r}") from None


def fill_parser(q: argparse.ArgumentParser) -> None:
    """The options of ``python -m bench plan-evaluation``."""
    q.add_argument("--model", required=True, choices=sorted(MODEL_CONFIGS))
    q.add_argument("--num-layers", dest="n_layer", type=POSITIVE_INT, default=None)
    q.add_argument("--seq-length", dest="seq_len", type=POSITIVE_INT, default=None)
    q.add_argument("--profile", default=None, help="this CPU's profile (default: the one --n-slices auto uses)")
    q.add_argument("--pp", type=POSITIVE_INT, required=True, help="pipeline stages")
    q.add_argument("--batch-size", type=POSITIVE_INT, required=True)
    q.add_argument("--micro-batch-size", type=POSITIVE_INT, default=1)
    q.add_argument("--granularity", type=POSITIVE_INT, default=8, help="the optimal slicing's token granularity")
    q.add_argument("--ks", type=_counts, default=None,
                   help="uniform slice counts, comma-separated (default 1,2,4,...,64)")
    q.add_argument("--steps", type=POSITIVE_INT, default=5)
    q.add_argument("--warmup", type=NONNEGATIVE_INT, default=1)
    q.add_argument("--rounds", type=POSITIVE_INT, default=1)
    q.add_argument("--network", default=None)
    q.add_argument("--out-dir", default=None)


def _profile(args: argparse.Namespace, cfg, out_dir: Path) -> dict | str:
    """This CPU's profile to evaluate the planner on (--profile, else the one ``--n-slices auto`` uses), or why
    the evaluation cannot go on (one line): judged with --out-dir, before the planner and any run."""
    if why := cannot_create_in(out_dir):
        return f"--out-dir {out_dir}: {why}"
    path = Path(args.profile) if args.profile else profile_path(cfg, "cpu")
    if args.profile and not path.is_file():
        return f"--profile {path}: {'a directory' if path.is_dir() else 'no such file'}, not a profile"
    if path is None or not path.is_file():
        return f"no profile for {cache_key(cfg, 'cpu')} (python -m ours.plan profile; or give --profile)"
    try:
        prof = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"--profile {path}: not a profile ({exc})"
    return prof if isinstance(prof, dict) else f"--profile {path}: not a profile (not a JSON object)"


def run(args: argparse.Namespace) -> int:
    """Evaluate the planner on this CPU's profile of the layout's shape; the table, and its files under --out-dir."""
    cfg = get_model_config(args.model).with_overrides(n_layer=args.n_layer, seq_len=args.seq_len)
    out_dir = Path(args.out_dir or Path("results") / "plan" / f"eval-{cfg.name}-pp{args.pp}-B{args.batch_size}"
                   f"-b{args.micro_batch_size}")
    prof = _profile(args, cfg, out_dir)
    if isinstance(prof, str):
        print(f"python -m bench plan-evaluation: error: {prof}", file=sys.stderr)
        return 2
    fit = prof.get("p2p_fit") or {}
    link = Link(max(0.0, fit["latency"]), fit["bandwidth"]) if fit else None
    ks = args.ks or [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= cfg.seq_len // 8]
    extra = [a for flag, v in (("--num-layers", args.n_layer), ("--seq-length", args.seq_len),
                               ("--network", args.network)) if v for a in (flag, str(v))]
    res = evaluate(CpuCompute(prof), model=args.model, n_layer=cfg.n_layer, seq_len=cfg.seq_len, pp=args.pp,
                   batch_size=args.batch_size, micro=args.micro_batch_size, ks=ks, steps=args.steps,
                   warmup=args.warmup, out_dir=out_dir, granularity=args.granularity, rounds=args.rounds,
                   extra=extra, log=lambda s: print(s, flush=True), link=link)
    print(markdown(res))
    print(f"-> {out_dir}/evaluation.md, evaluation.json")
    return 0
