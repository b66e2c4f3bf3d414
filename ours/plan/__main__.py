"""python -m ours.plan {profile,fit,solve,layout}: TeraPipe's latency model, optimal slicing and layout.

    python -m ours.plan profile --model cpu-small [--quick] [--out FILE]
    python -m ours.plan fit --profile FILE [--out FILE]          # default out: the cache auto uses
    python -m ours.plan solve --model cpu-small --pp 2 --batch-size 2 [--micro-batch-size 1] [--granularity 8]
    python -m ours.plan layout --model gpt3-xl --devices 8 --gpus-per-node 8 --intra 5us,300GB/s --batch-size 64
        [--inter 10ms,1Gbps | --matrix FILE.json] [--gpu "V100 SXM2" | --tflops X] [--memory-gb 16] [--recompute]

Predicted against measured step times: ``python -m bench plan-evaluation`` (runs the run command).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from workload.configs import MODEL_CONFIGS, get_model_config


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _model(args):
    return get_model_config(args.model).with_overrides(n_layer=getattr(args, "n_layer", None),
                                                       seq_len=getattr(args, "seq_len", None))


def _load_latency_model(args, cfg):
    from ours.plan.auto import cache_key, fitted_model_path
    from ours.plan.latency import LatencyModel

    path = Path(args.latency_model) if args.latency_model else fitted_model_path(cfg, args.device)
    if path is None or not path.exists():
        sys.exit(f"python -m ours.plan: error: no fitted latency model for {cache_key(cfg, args.device)}; "
                 f"run profile and fit first, or give --latency-model")
    return LatencyModel.load(path), path


def cmd_profile(args) -> int:
    from ours.plan.auto import plan_dir
    from ours.plan.profile import ProfileGrid, profile

    cfg = _model(args)
    grid = ProfileGrid.quick(seq_len=cfg.seq_len) if args.quick else ProfileGrid()
    changes = {k: v for k, v in dict(batch_slices=args.batch_slices, granularity=args.granularity,
                                      context_step=args.context_step, reps=args.reps, stat=args.stat).items()
               if v is not None}
    if args.no_p2p:
        changes["p2p"] = False
    grid = ProfileGrid(**{**grid.__dict__, **changes})
    prof = profile(cfg, grid, args.device, progress=not args.no_progress)
    out = Path(args.out or plan_dir() / f"profile-{cfg.name}-{args.device}{'-quick' if args.quick else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(prof, indent=1))
    print(f"profile: {len(prof['layer'])} layer points, {len(prof['p2p'])} p2p sizes in {prof['seconds']:.1f} s "
          f"-> {out}")
    return 0


def cmd_fit(args) -> int:
    from ours.plan.auto import cache_key, plan_dir
    from ours.plan.latency import fit, merge_profiles
    from workload.configs import ModelConfig

    prof = merge_profiles([json.loads(Path(p).read_text()) for p in args.profile])
    lm = fit(prof)
    m = prof["model"]
    shape = ModelConfig(m.get("name", "?"), m["n_layer"], m["n_embd"], m["n_head"], m["seq_len"], m["vocab_size"])
    out = Path(args.out or plan_dir() / f"{cache_key(shape, prof.get('device', 'cpu'))}.json")
    lm.save(out)
    f = lm.meta["fit"]

    def fmt(name):
        e = f.get(name)
        if not e or e["n"] == 0:
            return f"{name}: -"
        return f"{name}: R2 {e['r2']:.4f}, MAPE {e['mape'] * 100:.2f} % (n={e['n']})"

    print(f"fit: alpha={lm.alpha:.3e} beta={lm.beta:.3e} gamma={lm.gamma:.3e} delta={lm.delta:.3e} s; "
          f"comm a={lm.comm_latency * 1e6:.1f} us bw={lm.comm_bandwidth / 1e9:.3f} GB/s")
    for name in ("t0_interp", "context_holdout", "context_all", "comm"):
        print("  " + fmt(name))
    print(f"-> {out}")
    return 0


def cmd_solve(args) -> int:
    from ours.plan.planner import plan

    cfg = _model(args)
    lm, path = _load_latency_model(args, cfg)
    bs = list(args.batch_slices) if args.batch_slices else ([args.micro_batch_size] if args.micro_batch_size else None)
    p = plan(lm, n_layer=cfg.n_layer, n_stages=args.pp, batch_size=args.batch_size, seq_len=cfg.seq_len,
             granularity=args.granularity, batch_slices=bs)
    d = p.to_dict()
    d.update(model=cfg.name, n_layer=cfg.n_layer, seq_len=cfg.seq_len, latency_model=str(path),
             step_parts=lm.step_time(p.slices, p.batch_slice, args.batch_size, cfg.n_layer, args.pp))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(d, indent=1))
    if args.json:
        print(json.dumps(d))
    print(p.summary())
    return 0


def cmd_layout(args) -> int:
    from ours.plan.layout import Cluster, Device, describe, parse_link, plan_layout
    from workload.flops import GPU_PEAK_TFLOPS

    cfg = _model(args)
    if args.matrix:
        cluster = Cluster.from_matrix(json.loads(Path(args.matrix).read_text()))
    else:
        if not args.devices:
            sys.exit("python -m ours.plan layout: error: give --devices N (with --intra / --inter) or --matrix FILE")
        links = {k: parse_link(v) if v else None for k, v in (("intra", args.intra), ("inter", args.inter))}
        cluster = Cluster(n_devices=args.devices, gpus_per_node=args.gpus_per_node, **links)
    if args.tflops is None:
        peaks = GPU_PEAK_TFLOPS.get(args.gpu)
        if not peaks or args.precision not in peaks:
            sys.exit(f"python -m ours.plan layout: error: no {args.precision} peak for --gpu {args.gpu!r} "
                     f"(known: {', '.join(GPU_PEAK_TFLOPS)}); give --tflops")
        args.tflops = peaks[args.precision]
    device = Device(tflops=args.tflops, memory_gb=args.memory_gb, efficiency=args.efficiency,
                    overhead=args.overhead_us * 1e-6)
    cands = plan_layout(cfg, cluster, device, batch_size=args.batch_size, batch_slice=args.micro_batch_size,
                        precision=args.precision, recompute=args.recompute, granularity=args.granularity)
    links = "per-link matrix" if args.matrix else ", ".join(
        f"{k} {v}" for k, v in (("inside a node", args.intra), ("between nodes", args.inter)) if v)
    print(f"{cfg.name}, {cluster.n_devices} devices ({cluster.gpus_per_node} a node; {links}), "
          f"{args.tflops:g} TFLOP/s x {args.efficiency:g}, {args.memory_gb:g} GB, batch {args.batch_size}, "
          f"batch slice {args.micro_batch_size}, {args.precision}{', recompute' if args.recompute else ''}")
    print(describe(cands))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ours.plan", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    def model_args(q, seq=True):
        q.add_argument("--model", required=True, choices=sorted(MODEL_CONFIGS))
        q.add_argument("--device", default="cpu", help="cpu | cuda")
        if seq:
            q.add_argument("--n-layer", "--num-layers", dest="n_layer", type=int, default=None)
            q.add_argument("--seq-len", "--seq-length", dest="seq_len", type=int, default=None)

    q = sub.add_parser("profile", help="measure one layer over a (b, l, c) grid, p2p latency, per-step extras")
    model_args(q)
    q.add_argument("--quick", action="store_true", help="coarse grid, b=1, 2 reps (seconds, not minutes)")
    q.add_argument("--batch-slices", type=_ints, default=None, help="b values, e.g. 1,2")
    q.add_argument("--granularity", type=int, default=None, help="l step of the c = 0 grid (default 8)")
    q.add_argument("--context-step", type=int, default=None, help="l and c step of the c > 0 grid (default 128)")
    q.add_argument("--reps", type=int, default=None)
    q.add_argument("--stat", choices=("min", "median"), default=None, help="of the reps (default min)")
    q.add_argument("--no-p2p", action="store_true")
    q.add_argument("--no-progress", action="store_true")
    q.add_argument("--out", default=None)
    q.set_defaults(fn=cmd_profile)

    q = sub.add_parser("fit", help="fit the latency model to a profile")
    q.add_argument("--profile", required=True, action="append",
                   help="a profile JSON; repeat to merge several (the fastest measurement of each point)")
    q.add_argument("--out", default=None, help="default: <plan dir>/<device>-h..-a..-s..-v...json (used by auto)")
    q.set_defaults(fn=cmd_fit)

    def plan_args(q):
        model_args(q)
        q.add_argument("--latency-model", default=None, help="a fitted model JSON (default: the cache)")
        q.add_argument("--pp", type=int, required=True, help="K, pipeline stages")
        q.add_argument("--batch-size", type=int, required=True)
        q.add_argument("--granularity", type=int, default=8)

    q = sub.add_parser("solve", help="the optimal slicing")
    plan_args(q)
    q.add_argument("--micro-batch-size", type=int, default=None, help="fix the batch slice (token slicing only)")
    q.add_argument("--batch-slices", type=_ints, default=None, help="batch slice sizes to try (default: divisors of B)")
    q.add_argument("--out", default=None)
    q.add_argument("--json", action="store_true", help="also print the plan as one JSON line")
    q.set_defaults(fn=cmd_solve)

    q = sub.add_parser("layout", help="choose T, P and the token slicing for a cluster (ours.plan.layout)")
    q.add_argument("--model", required=True, choices=sorted(MODEL_CONFIGS))
    q.add_argument("--n-layer", "--num-layers", dest="n_layer", type=int, default=None)
    q.add_argument("--seq-len", "--seq-length", dest="seq_len", type=int, default=None)
    q.add_argument("--devices", type=int, default=None, help="devices in all (with --intra / --inter)")
    q.add_argument("--gpus-per-node", type=int, default=1)
    q.add_argument("--intra", default=None, help="the links inside a node: LATENCY,BANDWIDTH, e.g. 5us,300GB/s")
    q.add_argument("--inter", default=None, help="the links between nodes, e.g. 10ms,1Gbps")
    q.add_argument("--matrix", default=None, help='a per-link matrix {"delay_ms": [[...]], "bandwidth_gbps": [[...]]}')
    q.add_argument("--gpu", default="V100 SXM2", help="the device's peak from workload.flops' table")
    q.add_argument("--tflops", type=float, default=None, help="the device's peak instead")
    q.add_argument("--memory-gb", type=float, default=16.0)
    q.add_argument("--efficiency", type=float, default=0.5, help="of the peak the layers' matmuls reach")
    q.add_argument("--overhead-us", type=float, default=200.0, help="fixed cost per layer and slice")
    q.add_argument("--batch-size", type=int, required=True)
    q.add_argument("--micro-batch-size", type=int, default=1, help="the batch slice")
    q.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    q.add_argument("--recompute", action="store_true")
    q.add_argument("--granularity", type=int, default=64, help="token slice boundaries at multiples of this")
    q.set_defaults(fn=cmd_layout)

    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
