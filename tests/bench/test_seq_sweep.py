"""bench seq-sweep's accounting, on made-up launches: ours against the fastest baseline of each sitting,
paired over neighbouring launches, and the sequence from which slicing pays."""
from __future__ import annotations

import argparse

from bench.seq_sweep import compare, model_args, pays_from
from bench.sittings import Run, Sitting


def _sitting(base: list[float], ours: list[float], slower: list[float] | None = None) -> Sitting:
    """Launched round-robin: base, [slower,] ours, then the reverse, and so on."""
    runs: dict[str, list[Run]] = {"torch_pipe gpipe": [], "torch_pipe 1f1b": [], "ours K=auto": []}
    at = 0
    for i, (b, o) in enumerate(zip(base, ours)):
        order = [("torch_pipe gpipe", b), ("torch_pipe 1f1b", (slower or base)[i] * 1.5), ("ours K=auto", o)]
        for name, t in (order if i % 2 == 0 else order[::-1]):
            runs[name].append(Run(t, t, (), details="auto, planner: K=8 (128x8)" if name.startswith("ours") else "",
                                  launched=at))
            at += 1
    return Sitting(1, runs)


def test_ours_meets_the_fastest_schedule_paired_over_neighbouring_launches():
    c = compare(_sitting([1.0, 1.2, 1.1], [0.8, 1.0, 1.0]))
    assert c["base"] == "torch_pipe gpipe" and c["ks"] == "auto, K=8"
    assert c["paired"].ratio.n == 3 and c["paired"].separated and c["paired"].ratio.low > 1
    assert compare(Sitting(1, {"torch_pipe gpipe": [None], "ours K=auto": []})) is None


def test_slicing_pays_from_the_shortest_sequence_faster_at_every_longer_one():
    faster = compare(_sitting([1.0, 1.2, 1.1], [0.8, 1.0, 1.0]))
    within = compare(_sitting([1.0, 1.2, 1.1], [1.1, 1.0, 1.2]))
    slower = compare(_sitting([1.0, 1.0, 1.0], [1.2, 1.3, 1.1]))
    assert not within["paired"].separated and slower["paired"].separated
    assert pays_from([(4096, faster), (1024, within), (2048, faster), (8192, faster)]) == 2048
    assert pays_from([(1024, faster), (2048, within), (4096, faster)]) == 4096  # 2048 breaks the run
    assert pays_from([(1024, faster), (2048, slower)]) is None
    assert pays_from([(1024, faster), (2048, None)]) is None  # a side failed at the longest


def test_each_family_at_the_sweeps_width():
    opts = argparse.Namespace(layers=2, hidden=128, heads=4, kv_heads=2, vocab=512)
    gpt, llama = model_args("gpt", 32768, opts), model_args("llama", 32768, opts)
    assert gpt[:2] == ["--model", "tiny"] and "--kv-heads" not in gpt and "32768" in gpt
    assert llama[:2] == ["--model", "llama-tiny"] and llama[-2:] == ["--kv-heads", "2"]
