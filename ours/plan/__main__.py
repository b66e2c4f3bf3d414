"""pipebench plan (python -m ours.plan) {profile,solve,layout}: TeraPipe's latency model, its optimal
token slicing and the layout (T, P) for a cluster, on the one compute model (``workload.compute``).

    pipebench plan profile --model cpu-small [--quick] [--out FILE]   # this CPU's profile (default out:
                                            # ours/plan/profiles/cpu-h..-a..-s..-v...json, where auto finds it)
    pipebench plan solve --model cpu-small --pp 2 --batch-size 2 [--micro-batch-size 1] [--device-file NAME]
        [--tp T --tp-link 5us,300GB/s] [--link 10ms,1Gbps]
    pipebench plan layout --model gpt3-xl --devices 8 --gpus-per-node 8 --intra 5us,300GB/s --batch-size 64
        [--inter 10ms,1Gbps | --matrix FILE.json] [--device-file "V100 SXM2 16GB"] [--memory-gb 16] [--recompute]
        [--scenario FILE.toml]   # the choice as a scenario: pipebench predict scenario FILE.toml, its whole step

P is the pipeline's stages and K its token slices, as everywhere in the suite. A request the planner
cannot answer is one line and exit status 2: solve's layout (--pp, --tp, --batch-size and
--micro-batch-size) is judged as the run command judges ours' run of it.
Predicted against measured step times: ``python -m bench plan-evaluation`` (runs the run command).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from contract.cli import DEVICE_FILE, POSITIVE_INT, Parser, cannot_write_file, number, old_names
from contract.links import given_link_error
from workload.configs import MODEL_CONFIGS, ModelConfig, get_model_config

PROG = "python -m ours.plan"  # the command's name where pipebench does not give its own
POSITIVE = number(float, 0, above=True)


class PlanError(ValueError):
    """A request the planner cannot answer as asked (one line, exit 2)."""


def _link(text: str) -> str:
    """--intra, --inter, --link, --tp-link: LATENCY,BANDWIDTH, judged by ``layout.parse_link``; the text."""
    from ours.plan.layout import parse_link

    try:
        parse_link(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _check_matrix(d) -> None:
    """ValueError unless ``d`` is N x N delays (ms) and bandwidths (Gbit/s), each pair of devices' within what
    a link may be (``contract.links.given_link_error``)."""
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    delay, bandwidth = d["delay_ms"], d["bandwidth_gbps"]
    n = len(delay)
    for name, rows in (("delay_ms", delay), ("bandwidth_gbps", bandwidth)):
        if not n or len(rows) != n or any(not isinstance(r, list) or len(r) != n for r in rows):
            raise ValueError(f"{name} is not {n} x {n}")
        bad = [x for r in rows for x in r if isinstance(x, bool) or not isinstance(x, (int, float))
               or not math.isfinite(x)]
        if bad:
            raise ValueError(f"{name} holds {bad[0]!r}")
    for i, j in ((i, j) for i in range(n) for j in range(n) if i != j):  # a device's link to itself is not used
        why = given_link_error(delay[i][j], bandwidth[i][j])
        if why:
            raise ValueError(f"[{i}][{j}]: {why}")


def _ints(text: str) -> tuple[int, ...]:
    """--batch-slices: comma-separated whole numbers >= 1."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"takes comma-separated whole numbers >= 1, got {text!r}")
    return values


def _model(args):
    return get_model_config(args.model).with_overrides(n_layer=getattr(args, "n_layer", None),
                                                       seq_len=getattr(args, "seq_len", None))


def _compute(args, cfg):
    """The compute model of ``--gpu NAME`` (a device file) or of this CPU (its profile)."""
    from ours.plan.auto import cache_key, profile_dir, profile_path
    from workload.compute import CpuCompute, DeviceError, gpu_compute

    if args.gpu:
        try:
            return gpu_compute(args.gpu, cfg, args.precision), args.gpu
        except DeviceError as exc:
            raise PlanError(str(exc)) from None
    path = profile_path(cfg, "cpu")
    if path is None:
        raise PlanError(f"no profile of {cache_key(cfg, 'cpu')} in {profile_dir()} (python -m ours.plan profile "
                        f"--model {args.model}), or give --device-file NAME")
    return CpuCompute(json.loads(path.read_text())), str(path)


def cmd_profile(args) -> int:
    from ours.plan.auto import cache_key, profile_dir
    from ours.plan.profile import profile

    cfg = _model(args)
    out = Path(args.out or profile_dir() / f"{cache_key(cfg, 'cpu')}.json")
    if why := cannot_write_file(str(out), "--out"):  # judged before the minutes of profiling
        raise PlanError(why)
    batch = args.batch_slices or ((1,) if args.quick else (1, 2))
    prof = profile(cfg, tuple(batch), reps=2 if args.quick else args.reps, p2p=not args.no_p2p,
                   progress=not args.no_progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(prof, indent=1))
    engine = prof.get("engine") or {}
    per_unit = ", ".join(f"{k} {1e3 * v['unit']:.2f} ms + {1e3 * v['layer']:.2f} ms/layer, x{1 + v['scale']:.2f}"
                         for k, v in engine.items() if isinstance(v, dict))
    print(f"profile: {len(prof['layer'])} layer points, {len(prof['slice'])} slice points in {prof['seconds']:.1f} s "
          f"-> {out}" + (f"; ours' engine per unit: {per_unit}" if per_unit else ""))
    return 0


def judge_layout(args, cfg: ModelConfig) -> None:
    """PlanError unless ours can run ``cfg`` as solve's flags lay it out: the run command's own judgement
    (``SystemSpec.validate``) of ours' run of it, so that a layout is refused here in the words and by
    the rules that refuse it there."""
    from contract import ConfigError, RunConfig
    from ours import SPEC

    if args.micro_batch_size is not None and args.batch_slices is not None:
        raise PlanError("give --micro-batch-size (one batch slice) or --batch-slices (the sizes to try), not both")
    run = RunConfig(system=SPEC.name, model=cfg, pp=args.pp, tp=args.tp, batch_size=args.batch_size,
                    micro_batch_size=args.micro_batch_size or 1, precision=args.precision, recompute=args.recompute,
                    options=SPEC.options())
    try:
        SPEC.validate(run)
    except ConfigError as exc:
        raise PlanError(str(exc)) from None


def cmd_solve(args) -> int:
    from ours.plan.layout import parse_link
    from ours.plan.planner import plan

    cfg = _model(args)
    judge_layout(args, cfg)
    if args.tp > 1 and args.tp_link is None:
        raise PlanError(f"--tp {args.tp} needs --tp-link LATENCY,BANDWIDTH (the links inside a tensor-parallel group, "
                        "e.g. 5us,300GB/s: each layer's all-reduces are charged on them)")
    if args.out and (why := cannot_write_file(args.out, "--out")):
        raise PlanError(why)
    cm, source = _compute(args, cfg)
    bs = list(args.batch_slices) if args.batch_slices else ([args.micro_batch_size] if args.micro_batch_size else None)
    link, tp_link = (parse_link(x) if x else None for x in (args.link, args.tp_link))
    try:
        p = plan(cm, cfg, n_stages=args.pp, batch_size=args.batch_size, tp=args.tp, recompute=args.recompute,
                 granularity=args.granularity, batch_slices=bs, link=link, tp_link=tp_link,
                 act_bytes=4 if args.precision == "fp32" else 2)
    except ValueError as exc:  # a --batch-slices size that does not divide the batch, no feasible slicing
        raise PlanError(str(exc)) from None
    d = p.to_dict()
    d.update(model=cfg.name, n_layer=cfg.n_layer, seq_len=cfg.seq_len, compute_model=source, link=args.link,
             tp_link=args.tp_link)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(d, indent=1))
    if args.json:
        print(json.dumps(d))
    print(p.summary())
    return 0


def cmd_layout(args) -> int:
    from ours.plan.layout import Cluster, describe, parse_link, plan_layout
    from workload.compute import DeviceError, gpu_compute

    cfg = _model(args)
    if args.matrix:
        try:
            matrix = json.loads(Path(args.matrix).read_bytes())
            _check_matrix(matrix)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else f"no {exc}" if isinstance(exc, KeyError) else str(exc)
            raise PlanError(f"--matrix {args.matrix}: not a per-link matrix {{\"delay_ms\": [[...]], "
                            f"\"bandwidth_gbps\": [[...]]}} of delays and bandwidths ({why})") from None
        if args.devices is not None and args.devices != len(matrix["delay_ms"]):
            raise PlanError(f"--devices {args.devices}, but --matrix {args.matrix} is of {len(matrix['delay_ms'])} "
                            "devices (the matrix says how many: leave out --devices)")
    elif not args.devices:
        raise PlanError("give --devices N (with --intra / --inter) or --matrix FILE")
    elif args.devices > args.gpus_per_node and args.inter is None:
        raise PlanError(f"--devices {args.devices} on nodes of --gpus-per-node {args.gpus_per_node} need --inter "
                        "LATENCY,BANDWIDTH (the links between nodes)")
    elif min(args.devices, args.gpus_per_node) > 1 and args.intra is None:
        raise PlanError(f"--gpus-per-node {args.gpus_per_node} needs --intra LATENCY,BANDWIDTH (the links inside "
                        "a node)")
    if args.scenario and not _whole_nodes(args):
        raise PlanError("--scenario: a scenario is of whole nodes over two tiers of links (--devices a multiple of "
                        "--gpus-per-node, --intra / --inter), not a per-link matrix of devices")
    if args.scenario and (why := cannot_write_file(args.scenario, "--scenario")):
        raise PlanError(why)
    try:
        if args.matrix:
            cluster = Cluster.from_matrix(matrix)
        else:
            links = {k: parse_link(v) if v else None for k, v in (("intra", args.intra), ("inter", args.inter))}
            cluster = Cluster(n_devices=args.devices, gpus_per_node=args.gpus_per_node, **links)
        cm = gpu_compute(args.gpu, cfg, args.precision)
        cands = plan_layout(cfg, cluster, cm, batch_size=args.batch_size, batch_slice=args.micro_batch_size,
                            recompute=args.recompute, granularity=args.granularity, memory_gb=args.memory_gb)
    except (ValueError, DeviceError, OSError) as exc:
        raise PlanError(str(exc)) from None
    if not cands[0].fits:
        least = min(cands, key=lambda c: c.memory_gb)
        has = f"--memory-gb {args.memory_gb:g}" if args.memory_gb is not None else \
            f"the {cm.device.usable_bytes() / 2**30:.1f} GiB a {cm.device.name} gives a run"
        raise PlanError(f"no layout of {cfg.name} on {cluster.n_devices} devices fits {has}: the least a device "
                        f"needs is {least.memory_gb:.1f} GiB of weights, gradients, Adam state and activations "
                        f"({least.label})")
    links = "per-link matrix" if args.matrix else ", ".join(
        f"{k} {v}" for k, v in (("inside a node", args.intra), ("between nodes", args.inter)) if v)
    print(f"{cfg.name}, {cluster.n_devices} x {cm.device.name} ({cluster.gpus_per_node} a node; {links}), "
          f"batch {args.batch_size}, batch slice {args.micro_batch_size}, {args.precision}"
          f"{', recompute' if args.recompute else ''}")
    print(describe(cands))
    print(_scenario(args, cfg, cands[0], cluster))
    return 0


def _toml(value) -> str:
    return str(value).lower() if isinstance(value, bool) else json.dumps(value)


def _whole_nodes(args) -> bool:
    """Whether layout's cluster can be written as a scenario: whole nodes over two tiers of links."""
    return not args.matrix and args.devices % min(args.gpus_per_node, args.devices) == 0


def _scenario(args, cfg: ModelConfig, best, cluster) -> str:
    """The chosen layout written as a scenario file (``--scenario FILE``) for the simulator's whole step
    (``pipebench predict scenario FILE``: the ranks in time, the optimizer too), or how to get one."""
    hint = "the whole step as the simulator predicts it (the ranks in time, the optimizer too): "
    if not _whole_nodes(args):
        return hint + "not written as a scenario (a scenario is of whole nodes over two tiers of links)"
    if not args.scenario:
        return hint + "--scenario FILE writes the chosen layout as a scenario, then pipebench predict scenario FILE"
    gpn = min(args.gpus_per_node, args.devices)
    run = dict(system="ours", model=cfg.name, num_layers=cfg.n_layer, seq_length=cfg.seq_len, tp=best.tp,
               pp=best.pp, dp=1, batch_size=args.batch_size, micro_batch_size=args.micro_batch_size,
               precision=args.precision, recompute=args.recompute, slices=",".join(map(str, best.slices)))
    nodes = dict(gpu=args.gpu, nodes=args.devices // gpn, gpus_per_node=gpn)
    for tier, link in (("intra", cluster.intra if gpn > 1 else None), ("inter", cluster.inter)):
        if link is not None:
            nodes.update({f"{tier}_gbps": link.bandwidth * 8 / 1e9, f"{tier}_delay_ms": link.latency * 1e3})
    body = "".join(f"[{name}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in table.items()) + "\n"
                   for name, table in (("run", run), ("cluster", nodes)))
    Path(args.scenario).parent.mkdir(parents=True, exist_ok=True)
    Path(args.scenario).write_text(f"# pipebench plan layout's choice: {best.label}, K={len(best.slices)}\n" + body)
    return hint + f"pipebench predict scenario {args.scenario}"


MODEL_FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig)}
PRECISIONS = ("fp32", "bf16", "fp16")


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    first, rest = __doc__.split("\n\n", 1)
    p = Parser(prog=prog, description=first, epilog=rest.rstrip())
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)

    def model_args(q):
        q.add_argument("--model", required=True, choices=sorted(MODEL_CONFIGS), help="the model by name")
        for name in ("n_layer", "seq_len"):  # the run command's flags for them (workload.configs)
            f = MODEL_FIELDS[name]
            q.add_argument(*f.metadata["flags"], dest=name, type=POSITIVE_INT, default=None,
                           help=f"{f.metadata['help']}{old_names(f.metadata['flags'])} (default: the --model's)")

    def device_file(q, default, said):
        q.add_argument(*DEVICE_FILE, dest="gpu", default=default, metavar="NAME",
                       help=f"a device file's name or path (workload/devices){old_names(DEVICE_FILE)}{said}")

    q = sub.add_parser("profile", help="this CPU's profile of a layer's operations (the CPU's compute model)")
    model_args(q)
    q.add_argument("--quick", action="store_true", help="b = 1, 2 repetitions (seconds, not minutes)")
    q.add_argument("--batch-slices", type=_ints, default=None, help="b values, e.g. 1,2 (default: 1,2; 1 with --quick)")
    q.add_argument("--reps", type=POSITIVE_INT, default=5, help="repetitions of each timing (2 with --quick)")
    q.add_argument("--no-p2p", action="store_true", help="leave out the point-to-point message timings")
    q.add_argument("--no-progress", action="store_true", help="print no progress while profiling")
    q.add_argument("--out", default=None, help="the profile's file (default: ours/plan/profiles/<the model's "
                   "shape>.json, where --n-slices auto finds it)")
    q.set_defaults(fn=cmd_profile)

    q = sub.add_parser("solve", help="the optimal token slicing of a pipeline (TeraPipe's formula, solved exactly)")
    model_args(q)
    device_file(q, None, " (default: this CPU's profile)")
    q.add_argument("--precision", choices=PRECISIONS, default="fp32", help="the run's precision policy")
    q.add_argument("--pp", type=POSITIVE_INT, required=True, help="P, pipeline stages")
    q.add_argument("--tp", type=POSITIVE_INT, default=1, help="T, tensor-parallel degree inside a stage")
    q.add_argument("--recompute", action="store_true", help="activation recomputation")
    q.add_argument("--batch-size", type=POSITIVE_INT, required=True, help="B, the pipeline's batch (sequences)")
    q.add_argument("--link", type=_link, default=None, help="the link between two stages: LATENCY,BANDWIDTH, "
                   "e.g. 10ms,1Gbps (s/ms/us/ns; Gbps/Mbps bits, GB/s/MB/s bytes; default: messages cost nothing)")
    q.add_argument("--tp-link", type=_link, default=None, help="the links inside a tensor-parallel group, "
                   "e.g. 5us,300GB/s (required with --tp > 1: each layer's all-reduces are charged on them)")
    q.add_argument("--granularity", type=POSITIVE_INT, default=None, help="token slice boundaries at multiples of "
                   "this (default: 8, coarser from 512 tokens on: at most 64 positions)")
    q.add_argument("--micro-batch-size", type=POSITIVE_INT, default=None,
                   help="b, the batch slice, fixed (default: each divisor of B tried)")
    q.add_argument("--batch-slices", type=_ints, default=None,
                   help="batch slice sizes b to try, e.g. 1,2 (default: each divisor of B)")
    q.add_argument("--out", default=None, help="also write the plan (JSON) to this file")
    q.add_argument("--json", action="store_true", help="also print the plan as one JSON line")
    q.set_defaults(fn=cmd_solve)

    q = sub.add_parser("layout", help="choose T, P and the token slicing for a cluster (ours.plan.layout)")
    model_args(q)
    q.add_argument("--devices", type=POSITIVE_INT, default=None, help="devices in all (with --intra / --inter; "
                   "with --matrix, its size)")
    q.add_argument("--gpus-per-node", type=POSITIVE_INT, default=1, help="devices a node (the links inside a node: "
                   "--intra)")
    q.add_argument("--intra", type=_link, default=None,
                   help="the links inside a node: LATENCY,BANDWIDTH, e.g. 5us,300GB/s (s/ms/us/ns; Gbps/Mbps bits, "
                   "GB/s/MB/s bytes)")
    q.add_argument("--inter", type=_link, default=None, help="the links between nodes, e.g. 10ms,1Gbps")
    q.add_argument("--matrix", default=None, help='a per-link matrix {"delay_ms": [[...]], "bandwidth_gbps": '
                   '[[...]]}, N x N for N devices')
    q.add_argument("--scenario", default=None, help="write the chosen layout as a scenario file, for its whole step "
                   "as the simulator predicts it (pipebench predict scenario FILE)")
    device_file(q, "V100 SXM2 16GB", "")
    q.add_argument("--memory-gb", type=POSITIVE, default=None, help="memory a device gives the run (default: the "
                   "device file's, less what is reserved)")
    q.add_argument("--batch-size", type=POSITIVE_INT, required=True, help="the batch (sequences)")
    q.add_argument("--micro-batch-size", type=POSITIVE_INT, default=1, help="the batch slice")
    q.add_argument("--precision", choices=PRECISIONS, default="fp32", help="the run's precision policy")
    q.add_argument("--recompute", action="store_true", help="activation recomputation")
    q.add_argument("--granularity", type=POSITIVE_INT, default=None, help="token slice boundaries at multiples of this")
    q.set_defaults(fn=cmd_layout)
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog or PROG).parse_args(argv)
    try:
        return args.fn(args)
    except PlanError as exc:
        print(f"{prog or PROG} {args.cmd}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
