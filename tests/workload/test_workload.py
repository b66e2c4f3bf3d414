import os

import torch

from workload.configs import MODEL_CONFIGS, get_model_config
from workload.data import TokenSource, synthetic_tokens
from workload.flops import flops_per_token
from workload.model import build_gpt, count_params, lm_loss
from workload.partition import build_stage, stage_specs

TINY = get_model_config("tiny").with_overrides(n_embd=64, seq_len=32, vocab_size=128)


def test_gpt3_family_shapes():
    shapes = {n: (c.n_layer, c.n_embd, c.n_head, c.seq_len) for n, c in MODEL_CONFIGS.items()}
    assert shapes["gpt3-xl"] == shapes["gpt3-1b"] == (24, 2048, 16, 2048)
    assert shapes["gpt3-175b"] == (96, 12288, 96, 2048)
    assert shapes["gpt3-1hm"] == (12, 768, 12, 2048)
    assert shapes["cpu-small"] == (4, 512, 8, 1024)


def test_init_is_deterministic_and_layout_independent():
    a, b = build_gpt(TINY, seed=3), build_gpt(TINY, seed=3)
    c = build_gpt(TINY, seed=4)
    sa, sb, sc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(sa[n], sb[n]) for n in sa)
    assert not torch.equal(sa["blocks.0.attn.c_attn.weight"], sc["blocks.0.attn.c_attn.weight"])
    for spec in stage_specs(TINY.n_layer, 2):
        stage = build_stage(TINY, spec, seed=3, device="cpu")
        for n, p in stage.named_parameters():
            assert torch.equal(p, sa[n]), n


def test_stages_compose_to_the_full_model():
    full = build_gpt(TINY, seed=0)
    stages = [build_stage(TINY, s, 0, "cpu") for s in stage_specs(TINY.n_layer, 4)]
    x = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len))
    h = x
    for s in stages:
        h = s(h)
    torch.testing.assert_close(h, full(x), rtol=0, atol=0)


def test_param_count_and_flops():
    model = build_gpt(TINY, seed=0)
    non_embedding = sum(p.numel() for n, p in model.named_parameters() if not n.startswith(("wte", "wpe")))
    assert non_embedding == count_params(TINY)
    assert flops_per_token(TINY) == 6 * count_params(TINY) + 12 * TINY.n_layer * TINY.n_embd * TINY.seq_len


def test_loss_is_mean_cross_entropy():
    logits = torch.zeros(2, 3, 5)
    targets = torch.zeros(2, 3, dtype=torch.long)
    assert abs(lm_loss(logits, targets).item() - torch.log(torch.tensor(5.0)).item()) < 1e-6


def test_data_is_deterministic_and_replicas_tile_the_global_batch():
    src = TokenSource(seq_len=16, vocab_size=50, seed=1)
    full = src.global_batch(step=2, rows=4)
    assert torch.equal(full, synthetic_tokens(1, 2, 4, 16, 50))
    assert not torch.equal(full, src.global_batch(step=3, rows=4))
    parts = [src.replica_batch(2, 2, d, 2) for d in range(2)]
    assert torch.equal(torch.cat([x for x, _ in parts]), full[:, :-1])
    assert torch.equal(torch.cat([y for _, y in parts]), full[:, 1:])


def test_text_data(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes(b"hello world, " * 20)
    src = TokenSource(seq_len=8, vocab_size=256, seed=0, text_path=str(f))
    x, y = src.replica_batch(0, 3, 0, 1)
    assert x.shape == (3, 8) and torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < 256 and x.dtype == torch.int64
    text = f.read_bytes()
    assert all(bytes(row.tolist()) in text for row in x)  # token id = byte value


def _resident_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_text_tokens_stay_compact(tmp_path):
    """A --data file is memory-mapped as byte tokens: a batch of a 256 MiB file costs the pages its
    rows touch, not the file (as int64 it would have held 2 GiB in every rank)."""
    f = tmp_path / "big.txt"
    with open(f, "wb") as fh:
        fh.truncate(256 << 20)  # sparse: no disk, no page cache until read
    before = _resident_bytes()
    x, y = TokenSource(seq_len=64, vocab_size=256, text_path=str(f)).replica_batch(0, 4, 0, 1)
    assert x.shape == (4, 64) and x.dtype == torch.int64
    assert _resident_bytes() - before < 32 << 20


def test_every_optimizer_of_the_list_is_made_and_keeps_its_state():
    """One list of optimizers (workload.configs.OPTIMIZERS): Adam two moments, SGD with momentum one
    buffer, plain SGD none, as the compute and memory models charge them."""
    from workload.configs import OPTIMIZERS, SGD_MOMENTUM, OptimizerConfig
    from workload.training import make_optimizer

    state = {}
    for kind in OPTIMIZERS:
        p = torch.nn.Parameter(torch.ones(3))
        opt = make_optimizer([p], OptimizerConfig(kind=kind, lr=0.1))
        p.grad = torch.ones(3)
        opt.step()
        state[kind] = sorted(k for k, v in opt.state[p].items() if torch.is_tensor(v) and v.numel() == 3)
        if kind == "sgd_momentum":
            assert opt.param_groups[0]["momentum"] == SGD_MOMENTUM
    assert state == {"adam": ["exp_avg", "exp_avg_sq"], "sgd": [], "sgd_momentum": ["momentum_buffer"]}
