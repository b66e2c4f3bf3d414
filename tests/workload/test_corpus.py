"""The byte-level corpora and their held-out splits; the held-out loss."""
from __future__ import annotations

import torch

from workload.configs import get_model_config
from workload.corpus import describe, read_corpus, split_sizes, stdlib_files
from workload.data import TokenSource
from workload.heldout import heldout_loss
from workload.model import build_gpt


def test_stdlib_corpus_holds_out_every_tenth_file_and_is_deterministic():
    files = stdlib_files()
    assert len(files) >= 100 and [f.name for f in files] == sorted(f.name for f in files)
    split = read_corpus("stdlib")
    held = [f for i, f in enumerate(files) if i % 10 == 9]
    assert split.heldout.tobytes() == b"".join(f.read_bytes().rstrip(b"\n") + b"\n" for f in held)
    assert len(split.train) + len(split.heldout) == sum(len(f.read_bytes().rstrip(b"\n")) + 1 for f in files)
    assert held[0].read_bytes()[:200] not in split.train.tobytes()  # a held-out file's text is not trained on
    d = describe("stdlib")
    assert d["files"] == len(files) and d["train_bytes"] == len(split.train) and len(d["sha256"]) == 64
    assert split_sizes("stdlib") == (len(split.train), len(split.heldout))


def test_a_file_keeps_its_last_tenth_for_the_eval(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes(bytes(i % 100 for i in range(900)) + bytes(range(150, 250)))  # 1000 bytes
    split = read_corpus(str(f))
    assert len(split.heldout) == 100 and split.train.tobytes() + split.heldout.tobytes() == f.read_bytes()
    assert split_sizes(str(f)) == (900, 100)
    src = TokenSource(seq_len=16, vocab_size=256, text_path=str(f))
    for step in range(5):  # windows of the training split only
        x, y = src.replica_batch(step, 8, 0, 1)
        assert int(x.max()) < 100 and int(y.max()) < 100
    hx, hy = src.heldout_batch(4)
    assert hx.shape == (4, 16) and torch.equal(hx[:, 1:], hy[:, :-1]) and int(hx.min()) >= 150
    assert hx[:, 0].tolist() == [150, 177, 205, 233]  # evenly spaced windows, the first at the split's start


def test_heldout_batch_is_fixed_and_apart_from_training_steps():
    src = TokenSource(seq_len=32, vocab_size=128, seed=3)
    a, _ = src.heldout_batch(4)
    b, _ = TokenSource(seq_len=32, vocab_size=128, seed=7).heldout_batch(4)
    assert torch.equal(a, b)  # the same for every seed
    assert not any(torch.equal(a, src.replica_batch(step, 4, 0, 1)[0]) for step in range(5))


def test_heldout_loss_of_a_fresh_model_is_near_uniform():
    cfg = get_model_config("tiny").with_overrides(vocab_size=256)
    loss = heldout_loss(build_gpt(cfg, seed=0), TokenSource(cfg.seq_len, cfg.vocab_size, text_path="stdlib"))
    assert abs(loss - torch.log(torch.tensor(256.0)).item()) < 0.7
