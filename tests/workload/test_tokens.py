"""Tokens of a corpus: the BPE (trained on the training split only, cached, deterministic), the held-out
unigram cross-entropy, the pydocs corpus and its fallback, and what the run command judges."""
from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest
from tokenizers import Tokenizer

from contract import ConfigError, RunConfig
from contract.spec import check_common
from workload import corpus
from workload.configs import get_model_config
from workload.data import TokenSource
from workload.tokens import (bpe_info, describe, heldout_starts, learned_short, prepare_bpe, read_tokens,
                             unigram_nats)

WORDS = ("the model reads a sentence and predicts the next word of the sentence; "
         "a pipeline sends activations from one stage to the next stage. ")


@pytest.fixture
def text(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEBENCH_CACHE", str(tmp_path / "cache"))
    read_tokens.cache_clear()
    f = tmp_path / "t.txt"
    f.write_text(WORDS * 40 + "HELD OUT TEXT zebra quagga okapi. " * 20)
    yield str(f)
    read_tokens.cache_clear()


def test_bpe_is_trained_on_the_training_split_cached_and_deterministic(text, tmp_path, monkeypatch):
    where = prepare_bpe(text, 300)
    info = json.loads((where / "info.json").read_text())
    split = read_tokens(text, "bpe", 300)
    assert split.train.dtype == np.uint16 and info["train_tokens"] == len(split.train)
    assert int(split.train.max()) < 300 and len(split.train) < 0.5 * len(corpus.read_corpus(text).train)
    tok = Tokenizer.from_file(str(where / "tokenizer.json"))
    assert tok.decode(split.heldout.tolist()) == bytes(corpus.read_corpus(text).heldout).decode()  # lossless
    assert "zebra" not in tok.get_vocab() and "Ġzebra" not in tok.get_vocab()  # held-out text is not trained on
    made = (where / "info.json").stat().st_mtime_ns
    assert prepare_bpe(text, 300) == where and (where / "info.json").stat().st_mtime_ns == made  # cached
    monkeypatch.setenv("PIPEBENCH_CACHE", str(tmp_path / "again"))  # made again elsewhere: the same
    other = prepare_bpe(text, 300)
    assert other != where and (other / "tokenizer.json").read_bytes() == (where / "tokenizer.json").read_bytes()
    assert np.array_equal(np.load(other / "train.npy"), split.train)


def test_token_source_and_describe_with_bpe(text):
    src = TokenSource(seq_len=16, vocab_size=300, text_path=text, tokenizer="bpe")
    x, y = src.replica_batch(0, 4, 0, 1)
    assert x.dtype == y.dtype and str(x.dtype) == "torch.int64" and int(x.max()) < 300
    hx, _ = src.heldout_batch(4)
    held = read_tokens(text, "bpe", 300).heldout
    assert hx[:, 0].tolist() == [int(held[s]) for s in heldout_starts(len(held), 16, 4)]
    d = describe(text, "bpe", 300, seq_len=16)
    assert d["tokenizer"]["kind"] == "bpe" and d["tokenizer"]["vocab_size"] == 300
    assert len(d["tokenizer"]["sha256"]) == 64
    assert d["tokenizer"]["settings"]["min_frequency"] == 2 and d["tokenizer"]["library"].startswith("tokenizers ")
    assert set(d["unigram_nats"]) == {"heldout", "eval_batch"} and d["unigram_nats"]["heldout"] > 0
    assert describe(text)["tokenizer"] == {"kind": "byte"}


def test_unigram_cross_entropy_is_add_one_smoothed_training_frequencies():
    train = np.array([0, 0, 0, 1], dtype=np.uint16)  # counts + 1 over 4 ids: 4, 2, 1, 1 of 8
    assert unigram_nats(train, np.array([0, 1]), 4) == pytest.approx(-(math.log(4 / 8) + math.log(2 / 8)) / 2)
    assert unigram_nats(train, np.array([3]), 4) == pytest.approx(math.log(8))  # unseen: smoothed, finite


def test_pydocs_is_the_documentation_or_else_the_stdlib(tmp_path, monkeypatch):
    root = tmp_path / "python{version}"
    for i in range(12):
        (tmp_path / f"python3.11/sub{i % 2}").mkdir(parents=True, exist_ok=True)
        (tmp_path / f"python3.11/sub{i % 2}/f{i:02d}.rst.txt").write_text(f"document {i}\n\n")
    monkeypatch.setattr(corpus, "DOCS", str(root))
    monkeypatch.setattr(corpus.sysconfig, "get_python_version", lambda: "3.11")
    text, files = corpus.builtin_files("pydocs")
    assert "documentation" in text and [f.parent.name + "/" + f.name for f in files][:2] == \
        ["sub0/f00.rst.txt", "sub0/f02.rst.txt"]  # sorted by their path under the root
    train, held = corpus.builtin_documents.__wrapped__("pydocs")
    assert len(train) == 11 and held == (files[9].read_bytes().rstrip(b"\n") + b"\n",)
    monkeypatch.setattr(corpus, "DOCS", str(tmp_path / "absent{version}"))
    text, files = corpus.builtin_files("pydocs")
    assert "stdlib" in text and files == corpus.stdlib_files()


def test_the_tokenizer_is_judged_before_launch():
    tiny = get_model_config("tiny")
    base = dict(system="reference", model=tiny, batch_size=1, micro_batch_size=1)
    with pytest.raises(ConfigError, match="--tokenizer bpe tokenizes text: it needs --data"):
        check_common(RunConfig(**base, tokenizer="bpe"))
    with pytest.raises(ConfigError, match="--vocab-size in 257..65536, got 256"):
        check_common(RunConfig(**{**base, "model": tiny.with_overrides(vocab_size=256)}, data="stdlib",
                               tokenizer="bpe"))
    with pytest.raises(ConfigError, match="byte.*needs --vocab-size >= 256"):
        check_common(RunConfig(**{**base, "model": tiny.with_overrides(vocab_size=128)}, data="stdlib"))
    check_common(RunConfig(**base, data="pydocs", tokenizer="bpe"))
    byte = RunConfig(**base, data="stdlib")
    assert "tokenizer" not in byte.identity()
    assert RunConfig(**base, data="stdlib", tokenizer="bpe").identity()["tokenizer"] == "bpe"


# -- issue #54 items 8 and 25: a damaged cache entry is named and made again; a BPE short of its vocabulary

@pytest.mark.parametrize("damage, says", [
    (lambda d: (d / "info.json").write_text("{broken"), "info.json unreadable"),
    (lambda d: (d / "train.npy").write_bytes((d / "train.npy").read_bytes()[:100]), "train.npy is not the file made"),
    (lambda d: (d / "tokenizer.json").write_text("garbage"), "tokenizer.json is not the file made"),
    (lambda d: (d / "heldout.npy").unlink(), "heldout.npy missing"),
], ids=["info", "truncated-ids", "tokenizer", "missing"])
def test_a_damaged_bpe_is_named_and_made_again(text, damage, says, capsys):
    where = prepare_bpe(text, 300)
    made = {p.name: p.read_bytes() for p in where.iterdir()}
    damage(where)
    read_tokens.cache_clear()
    assert prepare_bpe(text, 300) == where
    err = capsys.readouterr().err
    assert f"the cached BPE {where} is damaged ({says}" in err and "made again" in err
    assert {p.name: p.read_bytes() for p in where.iterdir()} == made  # deterministic: the same files again
    assert describe(text, "bpe", 300)["tokenizer"]["sha256"] == \
        hashlib.sha256((where / "tokenizer.json").read_bytes()).hexdigest()


def test_an_unwritable_cache_and_a_short_vocabulary_are_refused_before_launch(text, tmp_path, monkeypatch, capsys):
    from runners.run import main

    args = ["--system", "reference", "--model", "tiny", "--batch-size", "1", "--micro-batch-size", "1", "--steps",
            "1", "--data", text, "--tokenizer", "bpe", "--out", str(tmp_path / "r.jsonl")]
    monkeypatch.setenv("PIPEBENCH_CACHE", "/proc/nope")
    assert main([*args, "--vocab-size", "300"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "PIPEBENCH_CACHE=/proc/nope: cannot keep files in /proc/nope" in err, err
    monkeypatch.setenv("PIPEBENCH_CACHE", str(tmp_path / "cache"))
    assert main([*args, "--vocab-size", "60000"]) == 2
    learned = bpe_info(text, 60000)["learned_vocab"]
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--vocab-size 60000: the BPE trained on {text}'s training split learned only {learned} tokens" in last
    assert f"give --vocab-size {learned}" in last and not (tmp_path / "r.jsonl").exists()
    assert learned_short(text, learned) is None  # a BPE of that many tokens learns them all
