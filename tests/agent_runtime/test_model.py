"""Numerical parity of our MoE engine with `transformers`, family by family (fp32)."""

import pytest
import torch

from agent_runtime.model import load_model
from agent_runtime.model.generate import SamplingParams, generate
from tiny_checkpoints import FAMILIES, VOCAB, save_hf_checkpoint

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    path = save_hf_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, ref, load_model(path, dtype="float32")


def test_logits_match_transformers(pair):
    _, ref, ours = pair
    ids = torch.randint(0, VOCAB, (3, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits
        got = ours(ids).logits
    assert (expected - got).abs().max().item() < 1e-4


def test_routes_have_one_entry_per_token_and_moe_layer(pair):
    _, ref, ours = pair
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = ours(ids)
    a = ours.args
    assert out.routes.shape == (2, 9, a.num_moe_layers, a.top_k)
    assert int(out.routes.min()) >= 0 and int(out.routes.max()) < a.num_experts
    # the k experts of one token at one layer are distinct
    assert (out.routes.sort(-1).values.diff(dim=-1) > 0).all()


def test_32_greedy_tokens_match_transformers_generate(pair):
    _, ref, ours = pair
    ids = torch.randint(0, VOCAB, (1, 21), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, 21:]
    got = generate(ours, [ids[0].tolist()], SamplingParams(max_new_tokens=32))[0]
    assert got.tokens == expected.tolist()
    assert got.finish_reason == "length"


def test_incremental_decode_equals_full_forward(pair):
    _, _, ours = pair
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(4))
    cache = ours.new_cache(1, 16)
    with torch.no_grad():
        full = ours(ids).logits
        first = ours(ids[:, :10], cache=cache).logits
        rest = [ours(ids[:, t:t + 1], cache=cache).logits for t in range(10, 16)]
    step = torch.cat([first] + rest, dim=1)
    assert (full - step).abs().max().item() < 1e-4


def naive_experts(self, x, idx, w):
    """Token by token, expert by expert: the reference for the fused training path."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            g, u = (x[t:t + 1] @ self.gate_up[e].T).chunk(2, dim=-1)
            out[t] += w[t, j].to(x.dtype) * ((torch.nn.functional.silu(g) * u) @ self.down[e].T)[0]
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_training_gradients_match_transformers_and_a_naive_expert_loop(family, tmp_path, monkeypatch):
    path = save_hf_checkpoint(family, tmp_path)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref.model.embed_tokens.weight.requires_grad_(True)
    ref(ids).logits.log_softmax(-1).mean().backward()
    ours = load_model(path, dtype="float32").requires_grad_(True)
    ours(ids).logits.log_softmax(-1).mean().backward()
    grads = {n: p.grad.clone() for n, p in ours.named_parameters() if p.grad is not None}
    expected = ref.model.embed_tokens.weight.grad       # flows back through every expert
    assert (grads["embed_tokens.weight"] - expected).abs().max().item() < 1e-5

    from agent_runtime.model.model import Experts
    monkeypatch.setattr(Experts, "forward", naive_experts)
    naive = load_model(path, dtype="float32").requires_grad_(True)
    naive(ids).logits.log_softmax(-1).mean().backward()
    experts = [n for n in grads if ".experts." in n]
    assert experts
    for n, p in naive.named_parameters():
        if p.grad is not None:
            assert (grads[n] - p.grad).abs().max().item() < 1e-5, n


def test_a_bf16_cast_of_the_whole_model_keeps_fp32_rotary_frequencies(tmp_path):
    """`model.to(torch.bfloat16)` (how the trainers make their bf16 working copy) rounds the
    `inv_freq` buffer with the weights; the rotary tables must not follow it, or the copy
    trains on relative positions that loading the checkpoint in bf16 never shows (the shipped
    model was, by up to 0.73 radians a pair at 4,096 positions). Far positions, where the
    rounding shows: the same logits, bit for bit, as the model loaded in bf16."""
    path = save_hf_checkpoint("qwen3_moe", tmp_path / "m", max_position_embeddings=2048,
                              rope_theta=1e8)
    loaded = load_model(path, dtype="bfloat16")
    cast = load_model(path, dtype="float32").to(torch.bfloat16)
    assert cast.inv_freq.dtype == torch.bfloat16               # the buffer did round
    ids = torch.randint(0, VOCAB, (1, 2048), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = loaded(ids).logits[0, -64:]
        got = cast(ids).logits[0, -64:]
    assert torch.equal(expected, got)


def test_a_cache_finds_the_columns_its_rows_share_byte_for_byte():
    """`KVCache.share`: the columns every row holds the same keys and values in, each row
    from the first column it sees; a hint longer than the truth is searched down to it, a
    gap in a row ends them, a single row shares nothing, and dropping rows reorders where
    each row's shared columns start."""
    from agent_runtime.model.config import ModelArgs
    from agent_runtime.model.model import KVCache
    args = ModelArgs(model_type="qwen3_moe", vocab_size=16, hidden_size=16, num_heads=4,
                     num_experts=2, top_k=1, expert_size=8, num_layers=2, num_kv_heads=2,
                     head_dim=8)
    cache = KVCache(args, batch=3, max_len=40, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    common = [torch.randn(2, 20, 8, generator=g).bfloat16() for _ in range(4)]
    starts = [0, 3, 5]                                     # left padding of 0, 3 and 5
    for b, s in enumerate(starts):
        for t, c in zip(cache.k + cache.v, common):
            t[b, :, :s] = torch.nan
            t[b, :, s:s + 20] = c
            t[b, :, s + 20:30] = torch.randn(2, 10 - s, 8, generator=g).bfloat16()
        cache.valid[b, s:30] = True
    cache.pos = 30
    assert cache.share() == 20 and cache.shared_from.tolist() == starts
    assert cache.share(12) == 12                           # the callers' token hint caps it
    cache.k[1][2, 1, 5 + 14, 3] += 1                       # row 2 differs from its 15th column
    assert cache.share() == 14 and cache.share(30) == 14
    cache.valid[1, 3 + 9] = False                          # a hole in row 1
    assert cache.share() == 9
    assert cache.keep([2, 1]) == [2, 1] and cache.shared_from.tolist() == [5, 3]
    assert cache.keep([1]) == [1] and cache.share() == 0 and cache.shared_from is None
