"""The quality race: runs with eval points (``--eval-every``, ``contract.evaluation``) racing to a
held-out loss, as the report shows them.

A run's target is its ``--target-loss``; the report's ``--target`` stands in for runs recorded without
one. Per group (model, global batch, data and tokens, precision, optimizer, and the code commit where
the records come from more than one) and target: the race's target against the held-out unigram
cross-entropy and where synchronous training reaches it (``quality_target_lines``), then per network
setting the wall time, tokens and bytes sent to the target (``crossing``), bytes sent per token, which
wins (``quality_winners``) and how each column does against synchronous training
(``against_synchronous``), claimed only where the repetitions' intervals separate.
"""
from __future__ import annotations

import json
import statistics

import pandas as pd

from contract.estimate import BOOTSTRAP_FROM, estimate, no_difference, ratio_interval, separated
from contract.records import layout_words
from reporting.frame import commit_of, describe_oversubscription, network_row


def _mixed(records: list[dict]) -> bool:
    """Whether the records come from more than one code commit (a race's group then names its own)."""
    return len({commit_of(r) for r in records}) > 1


def _quality_group(r: dict, mixed: bool = False) -> str:
    """What a time-to-quality table's runs share: model, global batch, data and tokens, precision,
    optimizer; where the records come from several commits (``mixed``), the commit."""
    c = r.get("config") or {}
    shape = r["model_shape"]
    opt = c.get("optimizer") or {}
    corpus = (r.get("environment") or {}).get("corpus") or {}
    data = c.get("data") or "synthetic"
    if corpus.get("sha256"):
        data += f" (sha256 {corpus['sha256'][:12]})"
    if c.get("tokenizer", "byte") != "byte":
        data += f", {c['tokenizer']} {shape['vocab_size']}"
    return (f"model {r['model']} (L{shape['n_layer']} h{shape['n_embd']} a{shape['n_head']} s{shape['seq_len']}); "
            f"global batch {r['global_batch_size']}; data {data}; {r.get('precision', 'fp32')}; "
            f"{opt.get('kind', 'adam')} lr {opt.get('lr', 0):g}" + (f"; {commit_of(r)}" if mixed else ""))


CROSSING_RULE = ("the crossing is interpolated linearly (in loss) between the last eval above the target and the "
                 "first at or below it where the evaluated weights change every step; where they change only every "
                 "c steps (DiLoCo's global weights, at its syncs: c = H/F) it is the first eval at or below the "
                 "target, exact where the evals come every c steps")


def crossing(evals: list[dict], goal: float, every: int = 1) -> dict | None:
    """Where a run's held-out loss first reaches ``goal`` (``CROSSING_RULE``): its step, tokens,
    wall time and bytes sent (every rank's, summed), or None. ``every``: the steps between changes of
    the evaluated weights."""
    prev = None
    for e in evals:
        if e["loss"] <= goal:
            frac = 1.0
            if prev is not None and every == 1 and prev["loss"] > e["loss"]:
                frac = (prev["loss"] - goal) / (prev["loss"] - e["loss"])
            at = lambda key: prev[key] + frac * (e[key] - prev[key]) if prev is not None else e[key]  # noqa: E731
            return {"step": at("step"), "tokens": at("tokens"), "wall_time": at("wall_time"),
                    "bytes": (sum(prev["bytes_sent"]) + frac * (sum(e["bytes_sent"]) - sum(prev["bytes_sent"]))
                              if prev is not None else sum(e["bytes_sent"]))}
        prev = e
    return None


def quality_frame(records: list[dict], target: float | None = None) -> pd.DataFrame:
    """One row per ok run with eval points and a target: its repetition group (runs that differ only in
    ``--seed``), column, network setting, target and where it crossed it (``crossing``; the newest
    record of a repetition)."""
    rows, mixed = [], _mixed(records)
    for r in records:
        evals = r.get("evals") or []
        c = r.get("config") or {}
        goal = c.get("target_loss") if c.get("target_loss") is not None else target
        if r.get("status") != "ok" or not evals or goal is None:
            continue
        ident = json.loads(r["key"]) if r.get("key") else dict(c)
        ident.pop("seed", None)
        every = int((r.get("options") or {}).get("eval_weights_every") or 1)
        local_steps = "eval_weights_every" in (r.get("options") or {})  # replicas step apart (DiLoCo)
        hit = crossing(evals, goal, every)
        last = evals[-1]
        setting, label, order = network_row(r)
        rows.append({
            "repetitions": json.dumps(ident, sort_keys=True) + " of " + commit_of(r),
            "timestamp": r.get("timestamp", ""),
            "seed": c.get("seed", 0), "group": _quality_group(r, mixed), "target": goal,
            "column": f"{r.get('label') or r['system']} {layout_words(r['layout'])}",
            "network": setting, "network_label": label, "order": order, "network_name": r["network"],
            "reached": hit is not None, "steps": last["step"], "weights_every": every,
            "synchronous": not local_steps,
            "oversubscribed": describe_oversubscription(r["oversubscribed"]) if r.get("oversubscribed") else "",
            "time": hit["wall_time"] if hit else None, "tokens": hit["tokens"] if hit else None,
            "bytes": hit["bytes"] if hit else None,
            "bytes_per_token": sum(last["bytes_sent"]) / last["tokens"] if last["tokens"] else None,
            "evals": evals,
        })
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    return (df.sort_values("timestamp", kind="stable").drop_duplicates(["repetitions", "seed"], keep="last")
            .reset_index(drop=True))


def quality_targets(records: list[dict]) -> dict[str, dict]:
    """Per group (``_quality_group``): where synchronous training is at its token budget, from the
    reference's runs with eval points and no target (the newest record per seed): the tokens N of
    its last eval, the held-out losses there (one per seed) and their median, the race's target."""
    found: dict[str, dict[int, tuple[str, dict]]] = {}
    mixed = _mixed(records)
    for r in records:
        c = r.get("config") or {}
        if r.get("system") != "reference" or r.get("status") != "ok" or not r.get("evals") or c.get("target_loss"):
            continue
        seeds = found.setdefault(_quality_group(r, mixed), {})
        seed = c.get("seed", 0)
        if seed not in seeds or r.get("timestamp", "") >= seeds[seed][0]:
            seeds[seed] = (r.get("timestamp", ""), r["evals"][-1])
    out = {}
    for group, seeds in found.items():
        last = [e for _, e in seeds.values()]
        losses = [e["loss"] for e in last]
        out[group] = {"tokens": statistics.median(e["tokens"] for e in last), "losses": losses,
                      "loss": statistics.median(losses), "seeds": sorted(seeds)}
    return out


def _unigram(records: list[dict], group: str) -> float | None:
    """The held-out unigram cross-entropy over the eval batch of a group's text, as its runs recorded it."""
    mixed = _mixed(records)
    for r in records:
        uni = ((r.get("environment") or {}).get("corpus") or {}).get("unigram_nats")
        if uni and r.get("evals") and _quality_group(r, mixed) == group:
            return uni["eval_batch"]
    return None


MIN_BELOW_UNIGRAM = 0.5  # nats: a target above (unigram - this) measures little beyond token frequencies


def quality_target_lines(records: list[dict]) -> list[str]:
    """Per race (group and target): ``target: X nats (unigram: Y nats; synchronous at N tokens)``, the
    reference's losses there, and a warning where X is not MIN_BELOW_UNIGRAM below Y."""
    df = quality_frame(records)
    if df.empty:
        return []
    refs = quality_targets(records)
    lines = []
    for (group, goal), _ in df.groupby(["group", "target"], sort=False):
        uni, ref = _unigram(records, group), refs.get(group)
        uni_text = f"{uni:.3f}" if uni is not None else "?"
        tokens_text = f"{ref['tokens']:,.0f}" if ref else "?"
        line = f"target: {goal:.3f} nats (unigram: {uni_text} nats; synchronous at {tokens_text} tokens)"
        notes = []
        if ref:
            notes.append(f"the reference's held-out loss at {ref['tokens']:,.0f} tokens, seeds "
                         f"{', '.join(map(str, ref['seeds']))}: {', '.join(f'{x:.3f}' for x in ref['losses'])} "
                         f"(median {ref['loss']:.3f})")
        else:
            notes.append("no reference run with eval points in these records: where the target comes from is not shown")
        if uni is None:
            notes.append("the records carry no unigram cross-entropy")
        elif goal > uni - MIN_BELOW_UNIGRAM:
            notes.append(f"**the target is not {MIN_BELOW_UNIGRAM} nats below the unigram figure**: the race measures "
                         "little beyond learning token frequencies")
        lines.append(f"{line}\n\n{group}: " + "; ".join(notes) + ".")
    return lines


def _seconds(t: float) -> str:
    return f"{t:.1f} s" if t >= 10 else f"{t:.2f} s"


def _tokens(n: float) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else f"{n:.0f}"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _interval(values, fmt) -> str:
    """The median of a column's runs and its interval (``contract.estimate``): '12.3 s [11.0 s-14.1 s]'."""
    est = estimate(values)
    return fmt(est.median) + (f" [{fmt(est.low)}-{fmt(est.high)}]" if est.has_interval else " (1 run)")


def _to_target_cell(column: str, fmt):
    """A table's cell: the median and interval of ``column`` at the crossing over the runs that
    reached the target, how many did, or "not reached in N steps"."""
    def cell(runs: pd.DataFrame) -> str:
        reached = runs[runs["reached"]]
        n = len(runs)
        if reached.empty:
            return f"not reached in {int(runs['steps'].max())} steps" + (f" ({n} runs)" if n > 1 else "")
        text = _interval(reached[column], fmt)
        return (f"{len(reached)}/{n} reached: " + text) if len(reached) < n else text
    return cell


quality_cell = _to_target_cell("time", _seconds)


def quality_axes(g: pd.DataFrame) -> tuple[list[str], list[str]]:
    """(network settings, fastest to slowest; columns, in recorded order)."""
    return (list(g.sort_values("order", kind="stable")["network"].unique()),
            list(g.sort_values("timestamp", kind="stable")["column"].unique()))


def _quality_table(g: pd.DataFrame, value) -> str:
    nets, cols = quality_axes(g)
    labels = dict(zip(g["network"], g["network_label"]))
    rows = []
    for net in nets:
        at = g[g["network"] == net]
        rows.append([labels[net]] + [value(at[at["column"] == col]) if (at["column"] == col).any() else ""
                                     for col in cols])
    return pd.DataFrame(rows, columns=["Network setting", *cols]).to_markdown(index=False, tablefmt="github",
                                                                               disable_numparse=True)


def _bytes_cell(runs: pd.DataFrame) -> str:
    values = runs["bytes_per_token"].dropna()
    if values.empty:
        return ""
    return _interval(values, lambda b: f"{b:,.0f}" if b >= 10 else f"{b:.2f}")


def _to_target(est, column: str) -> str:
    return f"`{column}` {_seconds(est.median)} {est.plus_minus()}"


def quality_winners(g: pd.DataFrame) -> list[str]:
    """Per network setting: the fastest column to the target among those that reached it in every run,
    against the next, claimed only where their intervals separate (``contract.estimate``)."""
    lines = []
    for net in quality_axes(g)[0]:
        at = g[g["network"] == net]
        label = at["network_label"].iloc[0]
        done = sorted(((estimate(runs["time"]), col) for col, runs in at.groupby("column") if runs["reached"].all()),
                      key=lambda ec: ec[0].median)
        if not done:
            lines.append(f"- {label}: no column reached the target in every run")
            continue
        (best, col) = done[0]
        text = f"- {label}: {_to_target(best, col)}"
        if len(done) > 1:
            other, ocol = done[1]
            if separated(best, other):
                ratio, low, high = ratio_interval(other, best)
                text += f", **{ratio:.2f}x** ({low:.2f}-{high:.2f}x) faster than {_to_target(other, ocol)}"
            else:
                text += f" against {_to_target(other, ocol)}: {no_difference(best, other)}"
        missed = [c for c, runs in at.groupby("column") if not runs["reached"].all()]
        if missed:
            text += "; not reached in every run: " + ", ".join(f"`{c}`" for c in missed)
        lines.append(text)
    return lines


def _contention(g: pd.DataFrame) -> list[str]:
    """A note where a group's runs had more ranks than cores: their times hold CPU contention."""
    over = sorted(set(g["oversubscribed"]) - {""})
    if not over:
        return []
    every = "every run" if (g["oversubscribed"] != "").all() else "some runs"
    return [f"Oversubscribed: {every} here ({'; '.join(over)}): the times hold CPU contention, alike for every column "
            "that shares it; the tokens and bytes do not depend on it."]


def against_synchronous(g: pd.DataFrame) -> list[str]:
    """Per network setting, every column that reached the target in every run against the synchronous
    one (the runs whose replicas never step apart: a single such column), where their intervals
    separate; [] where there is no single synchronous column."""
    sync = g[g["synchronous"]]["column"].unique()
    if len(sync) != 1:
        return []
    lines = []
    for net in quality_axes(g)[0]:
        at = g[g["network"] == net]
        base = at[at["column"] == sync[0]]
        if base.empty or not base["reached"].all():
            continue
        b = estimate(base["time"])
        parts = []
        for col, runs in at[at["column"] != sync[0]].groupby("column", sort=False):
            if not runs["reached"].all():
                parts.append(f"`{col}` did not reach the target in every run")
                continue
            e = estimate(runs["time"])
            if separated(b, e):
                ratio, low, high = ratio_interval(b, e)
                word = "faster" if ratio > 1 else "slower"
                shown = ratio if ratio > 1 else 1 / ratio
                span = (low, high) if ratio > 1 else (1 / high, 1 / low)
                parts.append(f"{_to_target(e, col)}: **{shown:.2f}x** ({span[0]:.2f}-{span[1]:.2f}x) {word}")
            else:
                parts.append(f"{_to_target(e, col)}: {no_difference(b, e)}")
        lines.append(f"- {at['network_label'].iloc[0]}, against {_to_target(b, sync[0])}: " + "; ".join(parts))
    return lines


def quality_section(records: list[dict], target: float | None = None) -> str:
    """The time-to-quality section ("" if no record has eval points and a target)."""
    df = quality_frame(records, target)
    if df.empty:
        return ""
    parts = ["## Time to quality"]
    for (group, goal), g in df.groupby(["group", "target"], sort=False):
        parts += [f"### Held-out loss {goal:g}: {group}",
                  f"Cells: at the crossing of the target, the median over the runs that differ only in seed and "
                  f"in brackets its interval (``contract.estimate``: the min-max of the runs below {BOOTSTRAP_FROM}, "
                  f"a bootstrap 95 % interval of the median from {BOOTSTRAP_FROM}; one run has none); "
                  f"{CROSSING_RULE}. The time leaves out the harness's timing barriers and the evals; bytes are "
                  "every rank's TCP payload, summed.",
                  "#### Training wall time to the target", *_contention(g), _quality_table(g, quality_cell),
                  "Which wins (only where the intervals separate):\n\n" + "\n".join(quality_winners(g)),
                  *(["Against synchronous training (the ratio of medians and its range over the intervals, only "
                     "where they separate):\n\n" + "\n".join(against)] if (against := against_synchronous(g)) else []),
                  "#### Tokens to the target", _quality_table(g, _to_target_cell("tokens", _tokens)),
                  "#### Bytes sent to the target", _quality_table(g, _to_target_cell("bytes", _bytes)),
                  f"#### Bytes sent per token: {group}",
                  "Every rank's TCP payload bytes, summed, over the tokens trained, at the last eval.",
                  _quality_table(g, _bytes_cell)]
    return "\n\n".join(parts)

