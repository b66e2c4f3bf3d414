"""The run command: python -m runners.run --system NAME --model NAME ... (see --help).

Parse and judge the request (a bad one: one line on stderr, exit status 2, nothing written), launch
the ranks through torchrun, optionally verify against the single-process reference, and append one
RunRecord to --out (held for this run alone while it runs: a second run command or a sweep writing to
it at the same time is refused; a record that cannot be written is printed in full on stderr). Exit status: 0 ok, 1
a failed run, a failed verification or a record not written, 2 a bad request (or --out held by another writer), 130 /
143 interrupted by SIGINT / SIGTERM (the ranks are stopped and no record is written, so a resumed sweep runs it again).
"""
from __future__ import annotations

import signal
import sys
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from contract import ConfigError, RunConfig, SystemSpec
from contract.registry import get_system
from runners.record import hold_records, release_records
from runners.request import (Placement, build_parser, config_from_args, judge, placement_from_args,
                             resolve_devices)
from runners.tolerance import Tolerance, relative, verify_tolerance

if TYPE_CHECKING:  # torch is imported only once a request has been judged runnable
    from runners.launcher import LaunchResult
    from runners.record import RunRecord


class Interrupted(BaseException):
    """SIGINT or SIGTERM: the run stops, its ranks are killed, no record is written."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum, frame):
    for sig in (signal.SIGINT, signal.SIGTERM):  # one interruption: the clean-up then runs to its end
        signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signum)


@dataclass(frozen=True)
class Verification:
    max_abs_loss_diff: float
    max_abs_grad_diff: float
    max_rel_grad_diff: float  # of a parameter's largest reference |gradient|
    n_grads: int
    passed: bool
    reason: str = ""
    tolerance: str = ""  # the policy and tolerance judged by (Tolerance.describe)
    reference: str = "trained"  # trained beside the run, or "cached" (runners.reference_cache)

    def line(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        why = f" ({self.reason})" if self.reason else ""
        cached = "; reference cached" if self.reference == "cached" else ""
        return (f"verify ({self.tolerance}{cached}): max_abs_loss_diff={self.max_abs_loss_diff:.3e} "
                f"max_abs_grad_diff={self.max_abs_grad_diff:.3e} max_rel_grad_diff={self.max_rel_grad_diff:.3e} "
                f"grads={self.n_grads} {verdict}{why}")


def reference_config(cfg: RunConfig) -> RunConfig:
    """The same workload on one process: same seed, data and global batch (or, for a system that
    names one, the reference run its own way: diloco's, the outer step applied to the reference's steps)."""
    spec = get_system(cfg.system)
    if spec.reference is not None:
        return spec.reference(cfg)
    half = spec.half_weights and cfg.precision != "fp32"  # judged against the reference run the same way
    options = get_system("reference").options(half_weights=half)
    return cfg.replace(system="reference", pp=1, tp=1, dp=1, batch_size=cfg.global_batch_size, network="none",
                       network_matrix=None, p2p_semantics="gloo", options=options)


def reference_result(ref_cfg: RunConfig) -> tuple[LaunchResult, str]:
    """The reference's result: kept from an earlier run with the same key (``runners.reference_cache``)
    or trained now (and kept when ok). Returns it and "cached" or "trained"."""
    from runners import reference_cache
    from runners.launcher import LaunchResult, launch

    path = reference_cache.entry(ref_cfg)
    kept = reference_cache.load(path)
    if kept is not None:
        return LaunchResult("ok", None, kept[0], kept[1]), "cached"
    ref = launch(ref_cfg, 1, Placement(), single=True)
    if ref.status == "ok":
        reference_cache.store(path, ref.ranks, ref.grads)
    return ref, "trained"


def compare(run: LaunchResult, ref: LaunchResult, tolerance: Tolerance) -> Verification:
    from runners.record import merged_losses

    nan = float("nan")
    tol = tolerance.describe()
    if ref.status != "ok":
        return Verification(nan, nan, nan, 0, False, f"reference run {ref.status}: {ref.error}", tol)
    if run.status != "ok":
        return Verification(nan, nan, nan, 0, False, f"run {run.status}", tol)
    losses, ref_losses = merged_losses(run.ranks), merged_losses(ref.ranks)
    if len(losses) != len(ref_losses) or not losses:
        return Verification(nan, nan, nan, 0, False, f"{len(losses)} losses against {len(ref_losses)}", tol)
    # under --eval-every the held-out losses too (from each system's weights, contract.evaluation)
    evals, ref_evals = (next((r["evals"] for r in x.ranks if r.get("evals")), []) for x in (run, ref))
    if [e["step"] for e in evals] != [e["step"] for e in ref_evals]:
        return Verification(nan, nan, nan, 0, False, f"evals after steps {[e['step'] for e in evals]} against "
                                                     f"{[e['step'] for e in ref_evals]}", tol)
    loss_diff = max(abs(a - b) for a, b in [*zip(losses, ref_losses),
                                            *((e["loss"], f["loss"]) for e, f in zip(evals, ref_evals))])
    missing = sorted(set(ref.grads) - set(run.grads))
    extra = sorted(set(run.grads) - set(ref.grads))
    diffs = {n: float((run.grads[n] - ref.grads[n]).abs().max()) for n in ref.grads if n in run.grads}
    grad_diff = max(diffs.values(), default=nan)
    rel_diff = max((relative(d, float(ref.grads[n].abs().max())) for n, d in diffs.items()), default=nan)
    reason = ""
    if missing:
        reason = f"no gradient for {len(missing)} parameters, e.g. {missing[0]}"
    elif extra:
        reason = f"gradients for unknown parameters, e.g. {extra[0]}"
    judged = rel_diff if tolerance.relative else grad_diff
    passed = not reason and loss_diff <= tolerance.loss and judged <= tolerance.grad
    return Verification(loss_diff, grad_diff, rel_diff, len(run.grads), passed, reason, tol)


def corpus_line(corpus: dict) -> str:
    """One line on what a run trains on: the text, its tokens and their held-out unigram cross-entropy."""
    tok = corpus["tokenizer"]
    kind = f"BPE of {tok['vocab_size']} tokens" if tok["kind"] == "bpe" else "byte tokens"
    text = f" ({corpus['text']})" if corpus.get("text") else ""
    line = (f"data: {corpus['name']}{text}, {kind}: {corpus['train_tokens']:,} training and "
            f"{corpus['heldout_tokens']:,} held-out tokens")
    uni = corpus.get("unigram_nats")
    if uni:
        line += (f"; held-out unigram cross-entropy {uni['heldout']:.3f} nats (the eval batch's "
                 f"{uni['eval_batch']:.3f}): what a model without context reaches")
    return line


def execute(cfg: RunConfig, spec: SystemSpec, placement: Placement) -> tuple[RunRecord, Verification | None]:
    """Launch the run of ``spec`` (and the reference under --verify); its record and verification."""
    from runners.launcher import launch
    from runners.record import build_record, host_environment

    world = spec.processes(cfg)
    gpus_each = spec.devices_per_process(cfg) if (cfg.hardware or "").startswith("cuda") else 1
    env = dict(host_environment(cfg.hardware), device_count=world * gpus_each)
    if cfg.data is not None:
        from workload.tokens import describe

        # the text trained on and held out (its SHA-256), its tokenizer (a BPE made here, once) and unigram
        env["corpus"] = describe(cfg.data, cfg.tokenizer, cfg.model.vocab_size, cfg.model.seq_len)
        print(corpus_line(env["corpus"]), file=sys.stderr, flush=True)
    result = launch(cfg, world, placement)
    verification = None
    try:
        if cfg.verify and placement.node_rank == 0:  # node 0 has the ranks' results; another node has none to compare
            ref, how = reference_result(reference_config(cfg))
            try:
                verification = replace(compare(result, ref, verify_tolerance(cfg, spec.half_weights)), reference=how)
            finally:
                ref.remove_run_dir()
        if result.network is not None:
            env["network"] = result.network
        if result.faults is not None:
            env["faults"] = result.faults
        record = build_record(cfg, spec, result.status, result.error, result.ranks, env,
                              verify=verification.__dict__ if verification else None)
        record.withheld_output = result.withheld
    finally:
        result.remove_run_dir()
    return record, verification


def keep_record(out: str, record: RunRecord, prog: str) -> bool:
    """Append ``record`` to ``out``; where it cannot be written (a full disk, say), say why and print it
    in full on stderr, so that nothing measured is lost. True if it was written."""
    from runners.record import append_record

    try:
        append_record(out, record)
    except OSError as exc:
        print(f"{prog}: error: --out {out}: the record could not be written ({exc.strerror or exc}); here it is "
              "in full, to append to a records file by hand:", file=sys.stderr)
        print(record.to_json(), file=sys.stderr, flush=True)
        return False
    return True


def summary(rec: RunRecord, node0: bool = True) -> str:
    """The run in one line: its label, what it ran (precision included) and its step time, or why it has none."""
    if rec.status == "ok" and rec.median_step_time is None:
        if not node0:
            return f"{rec.label}: ok (this node's ranks finished; node 0 writes the record)"
        warmup, target = rec.config.get("warmup"), rec.config.get("target_loss")
        reached = next((e for e in rec.evals if target is not None and e["loss"] <= target), None)
        why = (f"the held-out loss reached --target-loss {target:g} at the eval after {reached['step']} steps, and "
               f"the run ended within its {warmup} warm-up step(s) (lower --warmup to time a step)") if reached \
            else "no step was measured"
        return f"{rec.label}: ok, no step time: {why}"
    if rec.status != "ok":
        return f"{rec.label}: {rec.status}: {rec.error}"
    details = f" [{rec.details}]" if rec.details else ""
    return (f"{rec.label}{details} {rec.model} {rec.precision} pp={rec.layout['pp']} tp={rec.layout['tp']} "
            f"dp={rec.layout['dp']} mb={rec.micro_batch_size}: median step {rec.median_step_time:.4f} s, "
            f"{rec.tokens_per_s:.0f} tokens/s, {rec.tflops_per_device:.3f} TFLOP/s per device, MFU {rec.mfu:.1%}")


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog=prog)
    args = parser.parse_args(argv)
    try:
        spec = get_system(args.system)
        cfg = config_from_args(args, spec)
        placement = placement_from_args(args)
        judge(cfg, spec, placement, args.out if placement.node_rank == 0 else None)
    except ConfigError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    held = None
    if args.out and placement.node_rank == 0:
        try:
            held = hold_records(args.out)
        except BlockingIOError:
            print(f"{parser.prog}: error: --out {args.out}: another run command or sweep is writing to it now, and "
                  "each would time the other's load (wait for it to end, or give another --out)", file=sys.stderr)
            return 2
    try:
        return _run(cfg, spec, placement, args.out, parser.prog)
    finally:
        if held is not None:
            release_records(held)


def _run(cfg: RunConfig, spec: SystemSpec, placement: Placement, out: str | None, prog: str) -> int:
    """The judged request run: its ranks launched, its record kept (``keep_record``); the exit status."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    try:
        # Importing torch swallows an exception raised inside it (the run then goes on with both
        # signals ignored, and so does its torchrun): hold the signals until the import is done.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            import runners.launcher  # noqa: F401
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            cfg = resolve_devices(cfg, spec, placement)  # the GPUs: the last judgement, once torch is imported
        except ConfigError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 2
        record, verification = execute(cfg, spec, placement)
        kept = not (out and placement.node_rank == 0) or keep_record(out, record, prog)
    except (Interrupted, KeyboardInterrupt, SystemExit) as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT if isinstance(exc, KeyboardInterrupt) \
            else (exc.code - 128 if isinstance(exc.code, int) and exc.code > 128 else signal.SIGTERM)
        print(f"{prog}: interrupted by {signal.Signals(signum).name}: ranks stopped, no record written",
              file=sys.stderr)
        return 128 + signum
    for warning in record.warnings:
        print(f"{prog}: warning: {warning}", file=sys.stderr)
    print(summary(record, placement.node_rank == 0))
    if verification is not None:
        print(verification.line())
    if record.status != "ok" or (verification is not None and not verification.passed) or not kept:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
