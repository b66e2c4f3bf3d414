"""Token ids of a corpus (``workload.corpus``), training and held-out, and the held-out unigram
cross-entropy: what a model without context reaches.

Tokenizers (``--tokenizer``):

- ``byte``: token id = byte value (needs vocab_size >= 256); a file's ids are its memory map.
- ``bpe``: a byte-level BPE of ``vocab_size`` tokens (GPT-2's byte alphabet, so that any text has a
  tokenization; no special tokens), trained with the ``tokenizers`` library on the training split
  only (``BPE_SETTINGS``): a built-in corpus's training files as documents, a text file's training
  split as one. Made once per corpus text, vocabulary and settings, and cached
  (``workload.cache``: ``tokens/<corpus sha256>-bpe<V>-<settings>/``: the tokenizer, both splits'
  ids as uint16 ``.npy``, memory-mapped by every rank, and ``info.json``, which keeps each file's
  SHA-256); the run command makes it before it launches (``prepare_bpe``, from its judgement), a
  file lock keeps two makers from racing, and an entry whose files are not the ones made (changed,
  truncated, missing; an ``info.json`` that is not JSON) is named on stderr and made again.
  Training and encoding are deterministic: the same text, vocabulary and library version give the
  same ids (``describe`` gives the tokenizer's SHA-256, which the record carries). A BPE that
  learns fewer tokens than asked (a small text has few pairs to merge) is refused by the run
  command (``learned_short``): its model would be built and timed with rows no token uses.

The held-out eval batch (``heldout_starts``) is ``EVAL_ROWS`` windows of the held-out ids at evenly
spaced starts. No torch: the run command describes the tokens before it imports torch.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from workload import cache
from workload.corpus import BUILTIN, Split, builtin_documents, describe as describe_corpus, read_corpus

TOKENIZERS = ("byte", "bpe")
EVAL_ROWS = 32  # sequences of the eval batch (32 x seq_len tokens)
BPE_MIN_VOCAB, BPE_MAX_VOCAB = 257, 1 << 16  # above the byte alphabet; ids fit uint16
# The BPE's training settings (part of its cache key and of the record); "version" changes with the
# way the text is fed to the trainer.
BPE_SETTINGS = {"model": "BPE", "pre_tokenizer": "ByteLevel(add_prefix_space=False)", "min_frequency": 2,
                "initial_alphabet": "ByteLevel", "special_tokens": [], "decode": "utf-8, errors=replace",
                "version": 1}


def check_vocab(tokenizer: str, vocab_size: int) -> str | None:
    """Why ``vocab_size`` does not fit ``tokenizer`` (the run command's words), or None."""
    if tokenizer == "byte" and vocab_size < 256:
        return f"--tokenizer byte (token = byte) needs --vocab-size >= 256, got {vocab_size}"
    if tokenizer == "bpe" and not BPE_MIN_VOCAB <= vocab_size <= BPE_MAX_VOCAB:
        return f"--tokenizer bpe needs --vocab-size in {BPE_MIN_VOCAB}..{BPE_MAX_VOCAB}, got {vocab_size}"
    return None


def _documents(source: str) -> tuple[list[str], list[str]]:
    """The training and held-out text a BPE sees: a built-in corpus's files, a file's two splits."""
    if source in BUILTIN:
        train, heldout = builtin_documents(source)
    else:
        split = read_corpus(source)
        train, heldout = (bytes(split.train),), (bytes(split.heldout),)
    return ([t.decode("utf-8", errors="replace") for t in train],
            [t.decode("utf-8", errors="replace") for t in heldout])


def _bpe_dir(source: str, vocab_size: int) -> Path:
    settings = hashlib.sha256(json.dumps(BPE_SETTINGS, sort_keys=True).encode()).hexdigest()[:8]
    return cache.cache_dir() / "tokens" / f"{describe_corpus(source)['sha256'][:16]}-bpe{vocab_size}-{settings}"


def _train_bpe(train: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=BPE_SETTINGS["min_frequency"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
                                  show_progress=False)
    tok.train_from_iterator(train, trainer=trainer)
    return tok


def _encode(tok, documents: list[str]) -> np.ndarray:
    ids = [np.asarray(e.ids, dtype=np.uint16) for e in tok.encode_batch(documents)]
    return np.concatenate(ids) if ids else np.zeros(0, dtype=np.uint16)


INFO = "info.json"  # the entry's manifest (workload.cache.seal): what it is, and its files' SHA-256


def _make_bpe(source: str, vocab_size: int, where: Path, final: Path) -> None:
    """Train the BPE, encode both splits and write them into ``where`` (a new directory, to become
    ``final``), sealed."""
    import tokenizers

    print(f"tokens: training a BPE of {vocab_size} tokens on {source}'s training split (once; cached in {final})",
          file=sys.stderr, flush=True)
    train, heldout = _documents(source)
    tok = _train_bpe(train, vocab_size)
    train_ids, heldout_ids = _encode(tok, train), _encode(tok, heldout)
    where.mkdir(parents=True)
    tok.save(str(where / "tokenizer.json"))
    np.save(where / "train.npy", train_ids)
    np.save(where / "heldout.npy", heldout_ids)
    cache.seal(where, INFO, {
        "kind": "bpe", "vocab_size": vocab_size, "learned_vocab": tok.get_vocab_size(), "settings": BPE_SETTINGS,
        "library": f"tokenizers {tokenizers.__version__}",
        "sha256": hashlib.sha256((where / "tokenizer.json").read_bytes()).hexdigest(),
        "train_tokens": len(train_ids), "heldout_tokens": len(heldout_ids)})


def prepare_bpe(source: str, vocab_size: int) -> Path:
    """The cached BPE of ``source`` with ``vocab_size`` tokens, its files checked against their
    digests; made if missing or damaged (one maker at a time: the others wait on a file lock and find
    it made). CacheError (one line) if the cache cannot keep it."""
    final = _bpe_dir(source, vocab_size)
    if cache.damage(final, INFO) is None:
        return final
    cache.writable(final.parent)
    with open(final.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        why = cache.damage(final, INFO)
        if why is not None:
            if why != cache.ABSENT:
                print(f"tokens: the cached BPE {final} is damaged ({why}): made again", file=sys.stderr, flush=True)
            tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".making-"))
            try:
                _make_bpe(source, vocab_size, tmp / "out", final)
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp / "out", final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def bpe_info(source: str, vocab_size: int) -> dict[str, Any]:
    """What the cached BPE of ``source`` is (its manifest, made if missing; CacheError if it cannot
    be): kind, vocab_size asked, learned_vocab, settings, library, the tokenizer's SHA-256, token counts."""
    return cache.manifest_of(prepare_bpe(source, vocab_size), INFO)


def learned_short(source: str, vocab_size: int) -> str | None:
    """Why a BPE of ``vocab_size`` tokens on ``source`` would not be one (the run command's words): it
    learned fewer tokens, so that the model's other rows would never be used; None if it learned them
    all. Makes the BPE if missing (CacheError if the cache cannot keep it)."""
    learned = bpe_info(source, vocab_size)["learned_vocab"]
    if learned >= vocab_size:
        return None
    return (f"--vocab-size {vocab_size}: the BPE trained on {source}'s training split learned only {learned} tokens "
            f"(its text has no more pairs seen {BPE_SETTINGS['min_frequency']} times to merge), so the model would "
            f"be built and timed with {vocab_size - learned} vocabulary rows no token uses: give --vocab-size "
            f"{learned} or a larger text")


@lru_cache(maxsize=4)
def read_tokens(source: str, tokenizer: str = "byte", vocab_size: int = 256) -> Split:
    """The training and held-out token ids of ``source`` under ``tokenizer`` (read-only arrays:
    bytes as uint8, BPE ids as uint16, memory-mapped)."""
    if tokenizer == "byte":
        return read_corpus(source)
    where = prepare_bpe(source, vocab_size)
    return Split(train=np.load(where / "train.npy", mmap_mode="r"),
                 heldout=np.load(where / "heldout.npy", mmap_mode="r"))


def heldout_starts(n_tokens: int, seq_len: int, rows: int = EVAL_ROWS) -> list[int]:
    """The eval batch's windows (each seq_len + 1 tokens) in a held-out split of ``n_tokens``: evenly
    spaced, the first at its start, the last at its end."""
    last = n_tokens - seq_len - 1
    return [i * last // max(rows - 1, 1) for i in range(rows)]


def unigram_nats(train: np.ndarray, targets: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats per token) of ``targets`` under the training ids' frequencies, add-one
    smoothed over the vocabulary: the loss of the best model that ignores context, as it would be
    estimated from the training split."""
    counts = np.bincount(np.asarray(train), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[np.asarray(targets, dtype=np.int64)].mean())


def unigram(split: Split, vocab_size: int, seq_len: int) -> dict[str, float]:
    """The held-out unigram cross-entropy: over the whole held-out split (``heldout``) and over the
    eval batch's targets (``eval_batch``: the tokens the eval's loss is measured on)."""
    starts = heldout_starts(len(split.heldout), seq_len)
    targets = np.concatenate([split.heldout[s + 1 : s + seq_len + 1] for s in starts])
    return {"heldout": unigram_nats(split.train, split.heldout, vocab_size),
            "eval_batch": unigram_nats(split.train, targets, vocab_size)}


def describe(source: str, tokenizer: str = "byte", vocab_size: int = 256, seq_len: int | None = None) -> dict[str, Any]:
    """What a run trained on, for its record: the corpus (``workload.corpus.describe``), its
    tokenizer (for BPE: its settings, SHA-256 and library, made here if not cached), the splits'
    token counts and, given the sequence length, the held-out unigram cross-entropy (``unigram``)."""
    out = describe_corpus(source)
    split = read_tokens(source, tokenizer, vocab_size)
    if tokenizer == "byte":
        out["tokenizer"] = {"kind": "byte"}
    else:
        info = bpe_info(source, vocab_size)
        out["tokenizer"] = {k: v for k, v in info.items() if k not in ("train_tokens", "heldout_tokens")}
    out.update(train_tokens=len(split.train), heldout_tokens=len(split.heldout))
    if seq_len is not None and len(split.heldout) > seq_len + 1:
        out["unigram_nats"] = unigram(split, vocab_size, seq_len)
    return out
