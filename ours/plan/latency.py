"""TeraPipe's latency model of one transformer layer, its fit from a profile, and slice latency tables.

Computation of one layer (forward + backward) on a slice of b sequences, l tokens, after c tokens of
context:

    t(b, l, c) = t0(b, l) + alpha * b * l + beta * b * c + gamma * b * l * c + delta

t0 is interpolated from the measurements with c = 0 (every l at the profile's granularity; contention
outliers dropped, then made non-decreasing in l); the c-dependent residual t - t0 of the measurements
with c > 0 is fitted by least squares (alpha, beta, gamma >= 0; the residual is clamped at 0).
Communication between two stages: a + bytes / bandwidth, fitted from a ping-pong.

A slice's latency on one stage (what the planner minimises over) is
    layers_per_stage * t(b, l, c) + 2 * comm(b * l * hidden * 4 bytes)   (activations out, gradients back)
the pipeline of K stages and M = B/b batch slices takes
    T = M * sum_i t_i + fill_factor * (K - 1) * max_i t_i
(fill_factor = 1 is TeraPipe's formula; the profile measures the share of t that is not weight
gradients, which the token pipeline computes once per step, outside the fill and drain), and the
whole training step adds what the pipeline formula does not hold: the head and loss of the
last stage, the optimizer step and a fixed per-step overhead (``StepOverhead``).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

BYTES_PER_ELEMENT = 4  # fp32 activations


def _interp_extrap(x: np.ndarray, xp: np.ndarray, fp: np.ndarray) -> np.ndarray:
    """Piecewise-linear interpolation; linear extrapolation above the grid, clamped below it."""
    x = np.asarray(x, dtype=np.float64)
    y = np.interp(x, xp, fp)
    if len(xp) >= 2:
        slope = (fp[-1] - fp[-2]) / (xp[-1] - xp[-2])
        y = np.where(x > xp[-1], fp[-1] + slope * (x - xp[-1]), y)
    return y


@dataclass
class StepOverhead:
    """Per-step work outside the pipeline formula, in seconds (per-token and per-parameter rates)."""

    head_per_token: float = 0.0  # ln_f + lm_head + loss, forward + backward, per token (last stage)
    embed_per_token: float = 0.0  # embeddings, forward + backward, per token (first stage)
    optimizer_per_param: float = 0.0  # optimizer step per parameter
    constant: float = 0.0  # everything else (barriers, zeroing, Python); calibrated by `evaluate`


@dataclass
class LatencyModel:
    # model shape the profile was taken for
    n_embd: int
    n_head: int
    seq_len: int
    vocab_size: int
    # t0: per profiled batch slice size b, t0 at the token lengths l_grid
    b_grid: list[int]
    l_grid: list[int]
    t0: list[list[float]]  # [len(b_grid)][len(l_grid)]
    alpha: float = 0.0
    beta: float = 0.0
    gamma: float = 0.0
    delta: float = 0.0
    comm_latency: float = 0.0  # a, seconds
    comm_bandwidth: float = math.inf  # bytes per second
    # weight of the pipeline's fill/drain term: T = M * sum t_i + fill_factor * (K - 1) * max t_i.
    # 1 is TeraPipe's formula; the profile measures the share of t that is not weight gradients,
    # which the token pipeline defers to one product per step (so it is not in the fill/drain).
    fill_factor: float = 1.0
    overhead: StepOverhead = field(default_factory=StepOverhead)
    meta: dict = field(default_factory=dict)  # device, torch version, fit errors, ...

    # --- evaluation -----------------------------------------------------------------------
    def t0_of(self, b: int, l) -> np.ndarray:
        lg = np.asarray(self.l_grid, dtype=np.float64)
        rows = np.asarray(self.t0, dtype=np.float64)
        bg = list(self.b_grid)
        if b in bg:
            return _interp_extrap(l, lg, rows[bg.index(b)])
        if len(bg) == 1:  # scale the one profiled batch slice size
            return _interp_extrap(l, lg, rows[0]) * (b / bg[0])
        order = np.argsort([abs(x - b) for x in bg])[:2]  # the two nearest, then linear in b
        (b1, r1), (b2, r2) = sorted((bg[i], rows[i]) for i in order)
        y1, y2 = _interp_extrap(l, lg, r1), _interp_extrap(l, lg, r2)
        return y1 + (y2 - y1) * (b - b1) / (b2 - b1)

    def layer_time(self, b: int, l, c) -> np.ndarray:
        l = np.asarray(l, dtype=np.float64)
        c = np.asarray(c, dtype=np.float64)
        resid = self.alpha * b * l + self.beta * b * c + self.gamma * b * l * c + self.delta
        # more context is never faster: the residual is clamped at 0 (a poor fit cannot make a
        # slice with context cheaper than without, or negative)
        return self.t0_of(b, l) + np.where(c > 0, np.maximum(resid, 0.0), 0.0)

    def layer_time_many(self, b, l, c) -> np.ndarray:
        """layer_time over arrays whose points may have different b."""
        b = np.asarray(b)
        out = np.empty(len(b))
        for bi in np.unique(b):
            m = b == bi
            out[m] = self.layer_time(int(bi), np.asarray(l)[m], np.asarray(c)[m])
        return out

    def comm_time(self, nbytes) -> np.ndarray:
        nbytes = np.asarray(nbytes, dtype=np.float64)
        return self.comm_latency + nbytes / self.comm_bandwidth

    def slice_time(self, b: int, l, c, layers_per_stage: int, n_stages: int) -> np.ndarray:
        """One slice's forward + backward latency on one stage, with its activations' communication."""
        t = layers_per_stage * self.layer_time(b, l, c)
        if n_stages > 1:
            t = t + 2 * self.comm_time(b * np.asarray(l, dtype=np.float64) * self.n_embd * BYTES_PER_ELEMENT)
        return t

    def boundaries(self, seq_len: int, granularity: int) -> np.ndarray:
        pos = list(range(0, seq_len, granularity)) + [seq_len]
        return np.asarray(pos, dtype=np.int64)

    def table(self, b: int, seq_len: int, granularity: int, layers_per_stage: int,
              n_stages: int) -> tuple[np.ndarray, np.ndarray]:
        """(boundary token positions, table[s, e] = latency of the slice from boundary s to e)."""
        pos = self.boundaries(seq_len, granularity)
        s, e = pos[:, None], pos[None, :]
        l = np.maximum(e - s, 0)
        t = self.slice_time(b, l, np.broadcast_to(s, l.shape), layers_per_stage, n_stages)
        t = np.where(e > s, t, np.inf)
        return pos, t

    def pipeline_time(self, slices, b: int, batch_size: int, n_layer: int, n_stages: int) -> float:
        lens = np.asarray(slices, dtype=np.float64)
        ctx = np.concatenate([[0.0], np.cumsum(lens)[:-1]])
        t = self.slice_time(b, lens, ctx, n_layer // n_stages, n_stages)
        return float((batch_size // b) * t.sum() + self.fill_factor * (n_stages - 1) * t.max())

    def step_time(self, slices, b: int, batch_size: int, n_layer: int, n_stages: int) -> dict:
        """Predicted time of a whole training step, with its parts."""
        o = self.overhead
        pipe = self.pipeline_time(slices, b, batch_size, n_layer, n_stages)
        tokens = batch_size * self.seq_len
        head = o.head_per_token * tokens
        # The first stage finishes last (its deferred weight gradients end the backward), so its
        # optimizer step is the one on the critical path: its layers and the embeddings.
        h = self.n_embd
        per_layer_params = 12 * h * h + 13 * h
        first_params = (n_layer // n_stages) * per_layer_params + self.vocab_size * h + self.seq_len * h
        if n_stages == 1:
            first_params += self.vocab_size * h + 2 * h
        opt = o.optimizer_per_param * first_params
        embed = o.embed_per_token * tokens
        total = pipe + head + opt + embed + o.constant
        return dict(total=total, pipeline=pipe, head=head, optimizer=opt, embed=embed, constant=o.constant)

    # --- persistence ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d["kind"] = "ours.plan.latency_model"
        if math.isinf(self.comm_bandwidth):
            d["comm_bandwidth"] = None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LatencyModel":
        d = {k: v for k, v in d.items() if k != "kind"}
        d["overhead"] = StepOverhead(**d.get("overhead", {}))
        if d.get("comm_bandwidth") is None:
            d["comm_bandwidth"] = math.inf
        return cls(**d)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "LatencyModel":
        return cls.from_dict(json.loads(Path(path).read_text()))


# --- fitting -------------------------------------------------------------------------------------
def _errors(y: np.ndarray, pred: np.ndarray) -> dict:
    y, pred = np.asarray(y, dtype=np.float64), np.asarray(pred, dtype=np.float64)
    if y.size == 0:
        return dict(n=0, r2=None, mape=None)
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    mape = float(np.mean(np.abs(pred - y) / np.abs(y)))
    return dict(n=int(y.size), r2=r2, mape=mape)


def fit_residual(b, l, c, resid, nonneg: bool = True) -> tuple[float, float, float, float]:
    """Least squares of resid = alpha*b*l + beta*b*c + gamma*b*l*c + delta.

    With ``nonneg``, alpha, beta and gamma are kept >= 0 (more tokens or more context is never
    cheaper): a coefficient that comes out negative is fixed at 0 and the others refitted."""
    b, l, c = (np.asarray(x, dtype=np.float64) for x in (b, l, c))
    y = np.asarray(resid, dtype=np.float64)
    A = np.stack([b * l, b * c, b * l * c, np.ones_like(b)], axis=1)
    free = [0, 1, 2, 3]
    while True:
        coef = np.zeros(4)
        sol, *_ = np.linalg.lstsq(A[:, free], y, rcond=None)
        coef[free] = sol
        neg = [i for i in free if i < 3 and coef[i] < 0] if nonneg else []
        if not neg:
            return tuple(float(x) for x in coef)
        free.remove(min(neg, key=lambda i: coef[i] * np.abs(A[:, i]).mean()))


def fit_comm(nbytes, times) -> tuple[float, float]:
    """(latency a, bandwidth bytes/s) of t = a + bytes / bandwidth, by least squares."""
    x = np.asarray(nbytes, dtype=np.float64)
    y = np.asarray(times, dtype=np.float64)
    if x.size == 0:
        return 0.0, math.inf
    if x.size == 1 or np.ptp(x) == 0:
        return float(y.mean()), math.inf
    A = np.stack([np.ones_like(x), x], axis=1)
    (a, inv_bw), *_ = np.linalg.lstsq(A, y, rcond=None)
    a = max(float(a), 0.0)
    bw = 1.0 / float(inv_bw) if inv_bw > 0 else math.inf
    return a, bw


def local_prediction(x: np.ndarray, y: np.ndarray, i: int, half: int = 3) -> float:
    """y at x[i] from its neighbours only: the median of the lines through every pair of them
    within ``half`` positions (exact on locally linear data, robust to a few outliers nearby)."""
    n = len(y)
    nb = [j for j in range(max(0, i - half), min(n, i + half + 1)) if j != i]
    preds = [y[j] + (y[k] - y[j]) * (x[i] - x[j]) / (x[k] - x[j])
             for a, j in enumerate(nb) for k in nb[a + 1:] if x[k] != x[j]]
    return float(np.median(preds)) if preds else float(y[i])


def clean_outliers(x: np.ndarray, y: np.ndarray, tol: float = 0.25, half: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Measurements on a shared machine have bursts of contention: a point more than ``tol`` off the
    prediction of its neighbours (``local_prediction``) is replaced by interpolation of the kept
    ones. Returns (cleaned y, mask of the points dropped)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if len(y) < 4:
        return y, np.zeros(len(y), dtype=bool)
    pred = np.array([local_prediction(x, y, i, half) for i in range(len(y))])
    bad = np.abs(y - pred) > tol * np.abs(pred)
    if bad.sum() > len(y) // 2:
        return y, np.zeros(len(y), dtype=bool)
    out = y.copy()
    out[bad] = _interp_extrap(x[bad], x[~bad], y[~bad])
    return out, bad


def isotonic(y: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence closest to y in least squares (pool adjacent violators)."""
    vals, wts, lens = [], [], []
    for v in np.asarray(y, dtype=np.float64):
        vals.append(v), wts.append(1.0), lens.append(1)
        while len(vals) > 1 and vals[-2] > vals[-1]:
            w = wts[-2] + wts[-1]
            v2 = (vals[-2] * wts[-2] + vals[-1] * wts[-1]) / w
            n = lens[-2] + lens[-1]
            vals[-2:], wts[-2:], lens[-2:] = [v2], [w], [n]
    return np.repeat(vals, lens)


def _t0_tables(points: list[dict]) -> tuple[list[int], list[int], np.ndarray]:
    """The c = 0 measurements as a (b, l) table; every b must cover the same l values."""
    zero = [p for p in points if p["c"] == 0]
    bs = sorted({int(p["b"]) for p in zero})
    ls = sorted({int(p["l"]) for p in zero})
    if not bs or not ls:
        raise ValueError("the profile has no measurements with c = 0")
    tab = np.full((len(bs), len(ls)), np.nan)
    for p in zero:
        tab[bs.index(int(p["b"])), ls.index(int(p["l"]))] = p["t"]
    for i in range(len(bs)):  # fill any hole by interpolation along l
        row, ok = tab[i], ~np.isnan(tab[i])
        if not ok.any():
            raise ValueError(f"no c = 0 measurement for b = {bs[i]}")
        tab[i] = np.interp(ls, np.asarray(ls)[ok], row[ok])
    return bs, ls, tab


def merge_profiles(profiles: list[dict]) -> dict:
    """One profile from several of the same shape: per (b, l, c) and per message size the fastest
    measurement (on a shared machine, contention only ever slows a measurement down)."""
    if len(profiles) == 1:
        return profiles[0]
    base = dict(profiles[0])
    shape = {k: base["model"][k] for k in ("n_embd", "n_head", "seq_len")}
    for p in profiles[1:]:
        if {k: p["model"][k] for k in shape} != shape:
            raise ValueError(f"profiles of different shapes: {shape} and {p['model']}")
    layer: dict = {}
    for p in profiles:
        for pt in p["layer"]:
            key = (pt["b"], pt["l"], pt["c"])
            if key not in layer or pt["t"] < layer[key]["t"]:
                layer[key] = pt
    p2p: dict = {}
    for p in profiles:
        for pt in p.get("p2p") or []:
            if pt["bytes"] not in p2p or pt["t"] < p2p[pt["bytes"]]["t"]:
                p2p[pt["bytes"]] = pt
    ov: dict = {}
    for p in profiles:
        for k, v in (p.get("overhead") or {}).items():
            if isinstance(v, (int, float)) and k != "fill_factor" and k != "optimizer_params":
                ov[k] = min(v, ov.get(k, v))
            elif k not in ov:
                ov[k] = v
    base.update(layer=sorted(layer.values(), key=lambda q: (q["b"], q["c"], q["l"])),
                p2p=sorted(p2p.values(), key=lambda q: q["bytes"]), overhead=ov, merged_from=len(profiles))
    return base


def fit(profile: dict, holdout_every: int = 4, outlier_tol: float | None = 0.25) -> LatencyModel:
    """Fit the latency model to a profile (see ours.plan.profile for its format).

    With ``outlier_tol``, contention outliers are dropped first: c = 0 points more than that
    (relative) off the prediction of their l-neighbours (``clean_outliers``), and c > 0 points more
    than that off a first fit; their numbers are reported (``t0_outliers``, ``context_outliers``) and the errors
    below are on the kept points (``*_with_outliers``: on all of them).

    Errors reported in ``meta['fit']``:
    - t0_interp: the c = 0 points at odd grid indices predicted by interpolating the even ones;
    - context_holdout: every ``holdout_every``-th c > 0 point predicted by a fit on the others;
    - context_all / comm: in-sample. The returned model is fitted on all points.
    """
    shape = profile["model"]
    points = profile["layer"]
    bs, ls, tab = _t0_tables(points)
    fit_err: dict = {}
    raw_tab = tab.copy()
    bad_mask = np.zeros(tab.shape, dtype=bool)
    if outlier_tol is not None:
        dropped = 0
        for i in range(len(bs)):
            tab[i], bad_mask[i] = clean_outliers(np.asarray(ls), tab[i], outlier_tol)
            dropped += int(bad_mask[i].sum())
            # a longer slice is never faster: without this the DP would pick the lengths that
            # happened to be measured fast
            tab[i] = isotonic(tab[i])
        fit_err["t0_outliers"] = dict(dropped=dropped, of=int(tab.size))
    # t0 interpolation, held out: odd indices from even ones
    if len(ls) >= 3:
        la = np.asarray(ls, dtype=np.float64)
        ys, ps = [], []
        for i in range(len(bs)):
            kept = ~bad_mask[i, 1::2]  # dropped points were themselves interpolated: not evidence
            ys.append(raw_tab[i, 1::2][kept])  # against the measurements, not the smoothed values
            ps.append(_interp_extrap(la[1::2], la[0::2], tab[i, 0::2])[kept])
        fit_err["t0_interp"] = _errors(np.concatenate(ys), np.concatenate(ps))
    if outlier_tol is not None and len(ls) >= 3:
        la = np.asarray(ls, dtype=np.float64)
        pr = [_interp_extrap(la, la, tab[i]) for i in range(len(bs))]
        fit_err["t0_with_outliers"] = _errors(raw_tab.ravel(), np.concatenate(pr))
    model = LatencyModel(n_embd=shape["n_embd"], n_head=shape["n_head"], seq_len=shape["seq_len"],
                         vocab_size=shape.get("vocab_size", 0), b_grid=bs, l_grid=ls, t0=tab.tolist())
    ctx = [p for p in points if p["c"] > 0 and int(p["b"]) in bs]
    if ctx:
        b = np.array([p["b"] for p in ctx], dtype=np.float64)
        l = np.array([p["l"] for p in ctx], dtype=np.float64)
        c = np.array([p["c"] for p in ctx], dtype=np.float64)
        y = np.array([p["t"] for p in ctx], dtype=np.float64)
        base = np.concatenate([model.t0_of(int(bi), [li]) for bi, li in zip(b, l)])
        keep = np.ones(len(ctx), dtype=bool)
        if outlier_tol is not None and len(ctx) >= 8:
            co = fit_residual(b, l, c, y - base)
            pred = base + co[0] * b * l + co[1] * b * c + co[2] * b * l * c + co[3]
            keep = np.abs(pred - y) <= outlier_tol * y
            if keep.sum() < 5:
                keep[:] = True
            fit_err["context_outliers"] = dict(dropped=int((~keep).sum()), of=len(ctx))
        b_all, l_all, c_all, y_all = b, l, c, y
        b, l, c, y, base = b[keep], l[keep], c[keep], y[keep], base[keep]
        if len(y) >= 2 * holdout_every and holdout_every > 1:
            test = np.arange(len(y)) % holdout_every == holdout_every - 1
            co = fit_residual(b[~test], l[~test], c[~test], (y - base)[~test])
            pred = base + np.maximum(co[0] * b * l + co[1] * b * c + co[2] * b * l * c + co[3], 0.0)
            fit_err["context_holdout"] = _errors(y[test], pred[test])
        co = fit_residual(b, l, c, y - base)
        model.alpha, model.beta, model.gamma, model.delta = co
        fit_err["context_all"] = _errors(y, model.layer_time_many(b, l, c))
        fit_err["context_all_with_outliers"] = _errors(y_all, model.layer_time_many(b_all, l_all, c_all))
    p2p = profile.get("p2p") or []
    if p2p:
        x = [p["bytes"] for p in p2p]
        t = [p["t"] for p in p2p]
        model.comm_latency, model.comm_bandwidth = fit_comm(x, t)
        fit_err["comm"] = _errors(t, model.comm_time(x))
    ov = profile.get("overhead") or {}
    model.fill_factor = float(ov.get("fill_factor", 1.0))
    model.overhead = StepOverhead(head_per_token=ov.get("head_per_token", 0.0),
                                  embed_per_token=ov.get("embed_per_token", 0.0),
                                  optimizer_per_param=ov.get("optimizer_per_param", 0.0),
                                  constant=ov.get("constant", 0.0))
    model.meta = {k: profile.get(k) for k in ("device", "device_name", "torch", "threads", "granularity", "created")}
    model.meta["model"] = shape
    model.meta["fit"] = fit_err
    return model

