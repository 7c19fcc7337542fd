"""The C++ decode step: bitwise the Python step's tokens, logprobs and routes, or not used."""

import os
import subprocess
import sys
import threading

import pytest
import torch

from agent_runtime.model import fast_decode, load_model
from agent_runtime.model.generate import SamplingParams, generate
from agent_runtime.model.prefix_cache import PrefixCache
from tiny_checkpoints import VOCAB, save_hf_checkpoint

COVERED = ("qwen3_moe", "mixtral")
# shapes whose every weight the extension packs (widths % 32, rows % 16: `packed_weight`)
PACKING = {"qwen3_moe": dict(hidden_size=64, head_dim=32, moe_intermediate_size=32),
           "mixtral": dict(hidden_size=64, intermediate_size=32)}
NOT_COVERED = {"qwen2_moe": "dense MLP layers", "olmoe": "full-width q/k norm",
               "granitemoe": "router topk_softmax"}


def _prompts(*lens):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]


def _both(monkeypatch, model, prompts, params, cache_mb=0, direct="1", **kw):
    out = {}
    monkeypatch.setenv(fast_decode.DIRECT, direct)
    for mode in ("0", "1"):
        monkeypatch.setenv(fast_decode.ENV, mode)
        cache = PrefixCache(max_bytes=cache_mb * 2**20) if cache_mb else None
        first = generate(model, prompts, params, prefix_cache=cache, **kw)
        again = generate(model, [p + g.tokens[:3] for p, g in zip(prompts, first)], params,
                         prefix_cache=cache, **kw) if cache else []
        out[mode] = first + again
    return out["0"], out["1"]


def _check_steps(monkeypatch, model, direct="1"):
    """The C++ step against the Python step on one row, left padding, 6 sampled rows of one
    prompt (read once: `shared_attention`) and the prefix cache."""
    assert fast_decode.stepper(model) is not None
    for prompts, params, cache_mb in [
            (_prompts(13), SamplingParams(max_new_tokens=20), 0),
            (_prompts(5, 17, 11), SamplingParams(max_new_tokens=16), 0),        # left padding
            (_prompts(9, 9, 9, 9, 9, 9), SamplingParams(max_new_tokens=12, temperature=1.0,
                                                         seed=3), 0),          # 6 rows sampled
            (_prompts(21, 8), SamplingParams(max_new_tokens=10), 8)]:          # prefix cache
        python, cpp = _both(monkeypatch, model, prompts, params, cache_mb, direct)
        for a, b in zip(python, cpp):
            assert a.tokens == b.tokens and a.logprobs == b.logprobs
            assert torch.equal(a.routes, b.routes) and a.finish_reason == b.finish_reason


@pytest.mark.parametrize("direct", ["1", "0"])
@pytest.mark.parametrize("family", COVERED + ("qwen3_moe+bias", "qwen3_moe+packed",
                                              "mixtral+packed"))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cpp_step_is_bitwise_the_python_step(built, monkeypatch, tmp_path, family, dtype,
                                                 direct):
    """Both ways the C++ step runs: on pointers (`decode_direct`, bf16 without biases; the
    others fall back) and through tensor operations (APPRENTICE_DECODE_DIRECT=0); "+packed":
    a shape whose weights the extension packs, so the direct step reads them packed."""
    name, _, variant = family.partition("+")
    over = {"bias": {"attention_bias": True}, "packed": PACKING.get(name, {})}.get(variant, {})
    model = load_model(save_hf_checkpoint(name, tmp_path / "m", **over), dtype=dtype)
    assert model.layers[0].self_attn.q_proj.bias is not None or variant != "bias"
    if variant == "packed" and dtype == "bfloat16" and fast_decode.extension().packs(64):
        assert len(fast_decode.packed_weights(model)) == 5 * len(model.layers) + 1
    _check_steps(monkeypatch, model, direct)


def _kernels_called(model, tokens=(3, 5)):
    """The extension's tensor-level kernels one C++ step called (their profiler records)."""
    from torch.profiler import ProfilerActivity, profile
    cache = model.new_cache(len(tokens), 8)
    model(torch.tensor([[1, 2]] * len(tokens)), cache=cache)
    step = fast_decode.stepper(model)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(torch.tensor(tokens), cache)
    return {e.name for e in prof.events() if e.name.startswith("apprentice::")}


def test_the_direct_step_calls_no_tensor_kernel_and_declines_what_it_does_not_cover(
        built, monkeypatch, tmp_path):
    """`decode_direct` serves a bf16 model without biases by itself (none of the extension's
    tensor-level kernels runs; the bitwise tests above would pass as well if it declined), with
    int8 copies of every weight `quantize` copies too, and leaves a model with biases, an fp32
    one, one whose experts' `down` has no copy and APPRENTICE_DECODE_DIRECT=0 to the tensor
    path. It serves on every CPU: a bf16 model's KV cache is bf16 even where prompts attend in
    fp32 (`UPCAST_CPU`: AVX2 without AVX512; `model.cache_dtype`)."""
    from agent_runtime.model.quantize import quantize
    plain = save_hf_checkpoint("qwen3_moe", tmp_path / "m")
    biased = save_hf_checkpoint("qwen3_moe", tmp_path / "b", attention_bias=True)
    wide = save_hf_checkpoint("qwen3_moe", tmp_path / "w", moe_intermediate_size=32)
    monkeypatch.setenv(fast_decode.DIRECT, "1")
    tensor_path = {"apprentice::rows_linear", "apprentice::rms_norm_rows", "apprentice::moe_rows"}
    int8_path = {"apprentice::int8_rows", "apprentice::moe_rows_i8"}
    assert _kernels_called(load_model(plain, dtype="bfloat16")) == set()
    assert _kernels_called(quantize(load_model(wide, dtype="bfloat16"))) == set()
    assert "apprentice::int8_rows" in _kernels_called(quantize(load_model(plain, dtype="bfloat16")))
    assert tensor_path <= _kernels_called(load_model(biased, dtype="bfloat16"))
    assert "apprentice::rows_linear" not in _kernels_called(load_model(plain, dtype="float32"))
    monkeypatch.setenv(fast_decode.DIRECT, "0")
    assert tensor_path <= _kernels_called(load_model(plain, dtype="bfloat16"))
    assert int8_path <= _kernels_called(quantize(load_model(wide, dtype="bfloat16")))


def test_a_group_that_shares_its_prompt_reads_it_once_with_the_python_steps_bits(
        built, monkeypatch, tmp_path):
    """Rows whose caches hold the same prompt (a GRPO group's first call; its later calls,
    which share the system prompt and task but start at different columns through the prefix
    cache) decode through `shared_attention`, with the Python step's tokens, logprobs and
    routes, rows finishing early included."""
    from agent_runtime.model.model import KVCache
    model = load_model(save_hf_checkpoint("qwen3_moe", tmp_path / "m"), dtype="bfloat16")
    seen = []
    share = KVCache.share
    monkeypatch.setattr(KVCache, "share", lambda self, *a: seen.append(share(self, *a)) or seen[-1])
    common, tails = _prompts(40)[0], _prompts(3, 11, 6, 1)
    cases = [([common] * 4, SamplingParams(max_new_tokens=14, temperature=1.0, seed=5), 0),
             ([common + t for t in tails], SamplingParams(max_new_tokens=12, temperature=1.0,
                                                          seed=6), 8)]
    for prompts, params, cache_mb in cases:       # a window of 59: rows of 5 to 12 new tokens
        python, cpp = _both(monkeypatch, model, prompts, params, cache_mb, window=59)
        assert len({len(g.tokens) for g in cpp}) > 1 or cache_mb == 0
        for a, b in zip(python, cpp):
            assert a.tokens == b.tokens and a.logprobs == b.logprobs
            assert torch.equal(a.routes, b.routes) and a.finish_reason == b.finish_reason
    assert seen[0] == 40 and all(n >= 40 for n in seen), seen


@pytest.mark.parametrize("family", sorted(NOT_COVERED))
def test_models_the_cpp_step_does_not_cover_decode_in_python(tmp_path, family):
    model = load_model(save_hf_checkpoint(family, tmp_path / "m"), dtype="float32")
    assert fast_decode.supported(model) == NOT_COVERED[family]
    assert fast_decode.stepper(model) is None


def test_the_environment_turns_it_off(built, monkeypatch, tmp_path):
    model = load_model(save_hf_checkpoint("qwen3_moe", tmp_path / "m"), dtype="float32")
    monkeypatch.setenv(fast_decode.ENV, "0")
    assert fast_decode.stepper(model) is None


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("experts,hidden,width,top_k", [(8, 64, 48, 2), (4, 40, 24, 3),
                                                        (16, 32, 80, 4)])
def test_the_fused_experts_are_bitwise_the_expert_by_expert_loops(built, monkeypatch, experts,
                                                                  hidden, width, top_k, int8):
    """`moe_rows` (all chosen experts of a decode step in one call) against the loops of
    `Experts.forward`, for one row (top-k order) and for several (`index_add_`'s sum); with
    int8 copies of the weights (`quantize`), `moe_rows_i8` against the loops over
    `int8_rows`."""
    from agent_runtime.model import model as M
    from agent_runtime.model.quantize import int8_weight, quantizable
    if int8 and width % 16:
        pytest.skip("no int8 copy of a weight whose width is not a multiple of 16")
    layer = M.Experts.__new__(M.Experts)
    torch.nn.Module.__init__(layer)
    g = torch.Generator().manual_seed(experts)
    layer.gate_up = torch.nn.Parameter(
        (torch.randn(experts, 2 * width, hidden, generator=g) * 0.1).bfloat16(), False)
    layer.down = torch.nn.Parameter(
        (torch.randn(experts, hidden, width, generator=g) * 0.1).bfloat16(), False)
    if int8:
        assert quantizable(layer.gate_up) and quantizable(layer.down)
        layer.q = int8_weight(layer.gate_up) + int8_weight(layer.down)
    for rows in range(1, M.KERNEL_ROWS + 1):
        for _ in range(4):
            x = torch.randn(rows, hidden, generator=g).bfloat16()
            w, idx = torch.randn(rows, experts, generator=g).softmax(-1).topk(top_k, -1)
            monkeypatch.setattr(M, "FUSED_EXPERTS", False)
            loops = layer(x, idx, w.bfloat16())
            monkeypatch.setattr(M, "FUSED_EXPERTS", True)
            fused = layer(x, idx, w.bfloat16())
            assert torch.equal(loops.view(torch.int16), fused.view(torch.int16)), (rows, top_k)


@pytest.mark.parametrize("kv,group,dim,length", [(2, 2, 64, 300), (4, 4, 64, 17), (4, 1, 128, 1),
                                                   (1, 12, 32, 100), (2, 3, 48, 33)])
def test_decode_attention_is_attention_and_a_row_alone_is_a_row_in_a_batch(built, kv, group,
                                                                           dim, length):
    """`decode_attention` (a decode step's attention in bf16) against float64 attention
    over the cache's first `length` columns, masked positions holding NaN keys and values
    that must not leak; within bf16's rounding of the output (what
    `scaled_dot_product_attention` in bf16 reaches), and each row's bits the same alone as
    in a batch of five."""
    import torch.nn.functional as F
    ext = fast_decode.extension()
    g = torch.Generator().manual_seed(length)
    B, cols, scale = 5, length + 7, dim ** -0.5
    q = torch.randn(B, kv, group, dim, generator=g).bfloat16()
    k_cache = torch.randn(B, kv, cols, dim, generator=g).bfloat16()
    v_cache = torch.randn(B, kv, cols, dim, generator=g).bfloat16()
    mask = torch.rand(B, 1, 1, length, generator=g) > 0.3
    mask[..., -1] = True                                   # a row's own new token
    hidden = ~mask[:, 0, 0][:, None, :, None].expand(B, kv, length, dim)
    k_cache[:, :, :length][hidden] = float("nan")
    v_cache[:, :, :length][hidden] = float("nan")
    k, v = k_cache[:, :, :length], v_cache[:, :, :length]
    out = ext.decode_attention(q, k, v, mask, scale)
    ref = F.scaled_dot_product_attention(q.double(), k.double().nan_to_num(),
                                         v.double().nan_to_num(), attn_mask=mask, scale=scale)
    assert not out.isnan().any()
    assert (out.double() - ref).abs().max() <= 2 ** -8 * ref.abs().max() + 1e-3
    for b in range(B):
        alone = ext.decode_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], mask[b:b + 1], scale)
        assert torch.equal(alone.view(torch.int16), out[b:b + 1].view(torch.int16))


@pytest.mark.parametrize("pad,gap,dim", [(13, 0, 64), (0, 5, 64), (7, 23, 32), (16, 16, 64),
                                         (3, 40, 128)])
@pytest.mark.parametrize("new", [1, 20])
def test_attention_gives_a_row_the_same_bits_wherever_padding_puts_its_keys(
        built, pad, gap, dim, new):
    """A batch lays a row out as [pad | cached prefix | pad | new tokens]: the row's keys and
    values, seen through the mask, give the bits they give laid out alone from column 0 (the
    softmax's sum counts the seen columns, not their places), in a decode step and in a
    prefill (causal over the new tokens), so a call's logits do not depend on its batch."""
    ext = fast_decode.extension()
    g = torch.Generator().manual_seed(pad * 100 + gap + new)
    kv, group, prefix, scale = 2, 2, 90, dim ** -0.5
    S = prefix + new
    q = torch.randn(1, kv, group, new, dim, generator=g).bfloat16()
    k = torch.randn(1, kv, S, dim, generator=g).bfloat16()
    v = torch.randn(1, kv, S, dim, generator=g).bfloat16()
    cols = torch.cat([torch.arange(pad, pad + prefix), torch.arange(pad + prefix + gap,
                                                                    pad + prefix + gap + new)])
    width = pad + prefix + gap + new
    kp = torch.full((1, kv, width, dim), float("nan")).bfloat16()
    vp = torch.full((1, kv, width, dim), float("nan")).bfloat16()
    kp[:, :, cols], vp[:, :, cols] = k, v
    seen = torch.zeros(1, new, width, dtype=torch.bool)
    for t in range(new):                                   # causal over the new tokens
        seen[0, t, cols[:prefix + t + 1]] = True
    alone = ext.attention_rows(q, k, v, None, True, scale)
    laid_out = ext.attention_rows(q, kp, vp, seen, False, scale)
    assert torch.equal(alone.view(torch.int16), laid_out.view(torch.int16))
    # the softmax's sum itself (an output rounded to bf16 rarely shows one fp32 step of it)
    for _ in range(30):
        scores = torch.randn(width, generator=g) * 4
        for t in range(new):
            assert ext.softmax_total(scores[cols[:prefix + t + 1]]) == \
                ext.softmax_total(scores, seen[0, t]) == \
                ext.softmax_total(scores, seen[0, t], int(cols[prefix + t]) + 1)
    if new == 1:
        step = ext.decode_attention(q[:, :, :, 0], kp, vp, seen[:, None, :, :], scale)
        assert torch.equal(step.view(torch.int16), alone[:, :, :, 0].view(torch.int16))


@pytest.mark.parametrize("B,kv,group,dim,length,shared,offset", [
    (8, 2, 2, 64, 300, 256, 0), (8, 2, 2, 64, 300, 200, 40), (3, 4, 4, 64, 40, 39, 0),
    (5, 1, 12, 32, 100, 3, 9), (2, 2, 3, 48, 33, 1, 0), (9, 2, 2, 64, 70, 60, 9),
    (4, 2, 2, 64, 50, 20, 5)])
def test_decode_attention_over_a_shared_prompt_gives_each_row_its_own_bits(
        built, B, kv, group, dim, length, shared, offset):
    """`decode_attention` told that every row holds the same `shared` columns, row b from its
    column from[b] on (a group's common prompt, read once for all rows), gives each row the
    bits it gets alone: rows that start at different columns (NaN in the padding before),
    with holes after the shared columns (NaN), shared columns up to the whole cache. What a
    mask contradicts (a shared column hidden, an earlier column seen) is not read as shared
    and changes nothing."""
    ext = fast_decode.extension()
    g = torch.Generator().manual_seed(length + shared + offset)
    scale = dim ** -0.5
    q = torch.randn(B, kv, group, dim, generator=g).bfloat16()
    k = torch.randn(B, kv, length, dim, generator=g).bfloat16()
    v = torch.randn(B, kv, length, dim, generator=g).bfloat16()
    common_k = torch.randn(kv, shared, dim, generator=g).bfloat16()
    common_v = torch.randn(kv, shared, dim, generator=g).bfloat16()
    start = torch.randint(0, offset + 1, (B,), generator=g) if offset else torch.zeros(B, dtype=torch.long)
    mask = torch.ones(B, 1, 1, length, dtype=torch.bool)
    for b in range(B):
        o = int(start[b])
        mask[b, ..., :o] = False
        k[b, :, o:o + shared], v[b, :, o:o + shared] = common_k, common_v
        if b % 2 and o + shared + 1 < length:                # a hole after the shared columns
            end = min(length - 1, o + shared + 1 + b)
            mask[b, ..., o + shared:end] = False
        hidden = ~mask[b, 0, 0][None, :, None].expand(kv, length, dim)
        k[b][hidden] = float("nan")
        v[b][hidden] = float("nan")

    def each_alone(m):
        return [ext.decode_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], m[b:b + 1], scale)
                for b in range(B)]

    out = ext.decode_attention(q, k, v, mask, scale, shared=shared, **{"from": start})
    assert not out.isnan().any()
    for b, alone in enumerate(each_alone(mask)):
        assert torch.equal(alone.view(torch.int16), out[b:b + 1].view(torch.int16)), b
    for wrong in ("hidden", "seen"):
        m = mask.clone()
        b = B - 1
        if wrong == "hidden":
            m[b, ..., int(start[b]) + shared // 2] = False
        elif int(start[b]) > 0:
            m[b, ..., int(start[b]) - 1] = True
            k[b, :, int(start[b]) - 1] = v[b, :, int(start[b]) - 1] = 0.5
        out = ext.decode_attention(q, k, v, m, scale, shared=shared, **{"from": start})
        for b, alone in enumerate(each_alone(m)):
            assert torch.equal(alone.view(torch.int16), out[b:b + 1].view(torch.int16)), (wrong, b)


@pytest.mark.parametrize("kv,group,new,cols,dim", [(2, 2, 37, 50, 64), (1, 4, 20, 20, 64),
                                                   (3, 3, 9, 40, 32)])
@pytest.mark.parametrize("masked", [False, True])
def test_prefill_attention_is_attention_and_a_prompt_in_pieces_gets_the_same_bits(
        built, kv, group, new, cols, dim, masked):
    """`attention_rows` (bf16 inference attention of several new positions) against float64
    attention, causal or under a padding mask; and each new position attended alone, over
    only the keys before it (a prompt fed one token at a time, or in pieces through the
    prefix cache), gets the bits it gets in the whole. With 32 or more query rows a kv head
    (the first two cases) the whole takes keys packed 16 a register (`packed_scores`, on
    AVX512-BF16) and the pieces the row loop, so the two are checked against each other."""
    import torch.nn.functional as F
    ext = fast_decode.extension()
    g = torch.Generator().manual_seed(cols)
    B, past, scale = 2, cols - new, dim ** -0.5
    q = torch.randn(B, kv, group, new, dim, generator=g).bfloat16()
    k = torch.randn(B, kv, cols, dim, generator=g).bfloat16()
    v = torch.randn(B, kv, cols, dim, generator=g).bfloat16()
    pos = past + torch.arange(new)
    causal = torch.arange(cols)[None] <= pos[:, None]                        # [new, cols]
    mask = None
    if masked:
        pad = torch.rand(B, cols, generator=g) > 0.3
        mask = causal[None] & pad[:, None] | (torch.arange(cols)[None] == pos[:, None])[None]
    out = ext.attention_rows(q, k, v, mask, not masked, scale)
    seen = (causal[None].expand(B, new, cols) if mask is None else mask)[:, None]
    ref = F.scaled_dot_product_attention(
        q.double().reshape(B, kv * group, new, dim), k.double(), v.double(), attn_mask=seen,
        scale=scale, enable_gqa=True).reshape(out.shape)
    assert (out.double() - ref).abs().max() <= 2 ** -8 * ref.abs().max() + 1e-3
    for i in range(new):
        end = past + i + 1
        one = ext.attention_rows(q[:, :, :, i:i + 1].contiguous(), k[:, :, :end], v[:, :, :end],
                                 None if mask is None else mask[:, i:i + 1, :end],
                                 not masked, scale)
        assert torch.equal(one.view(torch.int16), out[:, :, :, i:i + 1].view(torch.int16)), i


@pytest.mark.parametrize("B,T,N,D", [(1, 1, 6, 64), (3, 17, 6, 64), (2, 5, 3, 32), (1, 40, 20, 128)])
def test_rope_rows_is_the_aten_rotary_embedding_bit_for_bit(built, B, T, N, D):
    """`rope_rows` (q and k rotated in one pass) against the eager bf16 formula it replaces,
    `x * cos + rotate_half(x) * sin` on the transposed x: equal bit for bit, on values
    spread over many magnitudes so that every rounding shows."""
    from agent_runtime.model.model import rotate_half
    ext = fast_decode.extension()
    g = torch.Generator().manual_seed(B * 1000 + T * 10 + N)
    x = (torch.randn(B, T, N, D, generator=g) * torch.rand(B, T, N, 1, generator=g).mul(20).exp2()
         / 1024).bfloat16()
    angle = torch.rand(B, T, D, generator=g) * 100
    cos, sin = angle.cos().bfloat16()[:, None], angle.sin().bfloat16()[:, None]   # [B, 1, T, D]
    xt = x.transpose(1, 2)
    want = xt * cos + rotate_half(xt) * sin
    got = ext.rope_rows(x, cos, sin)
    assert got.shape == want.shape == (B, N, T, D)
    assert torch.equal(got.view(torch.int16), want.contiguous().view(torch.int16))


@pytest.mark.parametrize("width", [32, 40, 100, 1000, 1024])
def test_rows_linear_is_a_matmul_and_a_row_alone_is_a_row_in_a_batch(built, width):
    """`rows_linear` for 1-8 rows against x @ w.T + b in float64: at most one bf16 step
    apart (one rounding of an fp32 sum); widths with a partial last block of 32 take the
    masked tail after the whole blocks; a row alone gets its bits in every batch."""
    ext = fast_decode.extension()
    g = torch.Generator().manual_seed(width)
    w = torch.randn(37, width, generator=g).bfloat16()
    b = torch.randn(37, generator=g).bfloat16()
    x = torch.randn(8, width, generator=g).bfloat16()
    _check_rows(lambda xs: ext.rows_linear(xs, w, b), w.double(), x, b)


@pytest.mark.parametrize("width", [32, 64, 256])
@pytest.mark.parametrize("outputs", [8, 37, 160])
def test_packed_linear_has_rows_linears_bits_for_any_number_of_rows(built, width, outputs):
    """`packed_linear` on a packed weight: each row's outputs bitwise `rows_linear`'s for that
    row, with and without a bias, for 1 to 200 rows and outputs that are not whole blocks of
    16; `linear` takes it for bf16 matmuls of any size without a gradient."""
    from agent_runtime.model.model import linear, packed_weight
    ext = fast_decode.extension()
    if not ext.packs(width):
        pytest.skip("this build does not pack weights (no AVX512-BF16, or AMX tiles serve)")
    g = torch.Generator().manual_seed(width + outputs)
    w = torch.randn(outputs, width, generator=g).bfloat16()
    b = torch.randn(outputs, generator=g).bfloat16()
    x = torch.randn(200, width, generator=g).bfloat16()
    wp = ext.pack_weight(w)
    ref = torch.cat([ext.rows_linear(x[i:i + 8], w, b) for i in range(0, 200, 8)])
    plain = torch.cat([ext.rows_linear(x[i:i + 8], w, None) for i in range(0, 200, 8)])
    for rows in (1, 3, 8, 9, 17, 200):
        assert torch.equal(ext.packed_linear(x[:rows], wp, outputs, b).view(torch.int16),
                           ref[:rows].view(torch.int16)), rows
        assert torch.equal(ext.packed_linear(x[:rows], wp, outputs).view(torch.int16),
                           plain[:rows].view(torch.int16)), rows
    assert packed_weight(w) is packed_weight(w)                # made once per version
    assert torch.equal(linear(x, w, b).view(torch.int16), ref.view(torch.int16))
    with torch.no_grad():
        w.mul_(2)                                              # an in-place update repacks
    assert torch.equal(linear(x[:5], w).view(torch.int16),
                       ext.rows_linear(x[:5], w, None).view(torch.int16))


def test_keys_and_values_are_the_same_bits_decoded_or_prefilled(built, tmp_path):
    """Where weights are packed, a prefill computes every product as the decode step does:
    the keys and values a decode step wrote for its tokens are bitwise those a prefill of the
    same tokens writes, alone or in pieces of any size (experts then get fewer or more than 8
    rows). So a prompt gets the same logits whether its start came from the prefix cache
    after decoding or was prefilled."""
    name = "qwen3_moe"
    ext = fast_decode.extension()
    if not ext.packs(64):
        pytest.skip("this build does not pack weights (no AVX512-BF16, or AMX tiles serve)")
    model = load_model(save_hf_checkpoint(name, tmp_path / "m", **PACKING[name]),
                       dtype="bfloat16")
    prompt, n = _prompts(30)[0], 24
    step = fast_decode.stepper(model)
    cache = model.new_cache(1, 30 + n)
    with torch.no_grad():
        tok = model(torch.tensor([prompt]), cache=cache).logits[:, -1].argmax(-1)
        tokens = []
        for _ in range(n):
            tokens.append(int(tok))
            tok = step(tok, cache).logits[:, -1].argmax(-1)
    ids = prompt + tokens
    for pieces in ([len(ids)], [7, 8, 11, 41, len(ids)], [30, 31, len(ids)]):   # their ends
        fresh = model.new_cache(1, len(ids))
        with torch.no_grad():
            start = 0
            for end in pieces:
                model(torch.tensor([ids[start:end]]), cache=fresh)
                start = end
        for layer in range(len(model.layers)):
            for mine, theirs in ((cache.k, fresh.k), (cache.v, fresh.v)):
                assert torch.equal(mine[layer][..., :len(ids), :].view(torch.int16),
                                   theirs[layer][..., :len(ids), :].view(torch.int16)), \
                    (pieces, layer)


def _check_rows(product, weight, x, b):
    """`product` of 1-8 rows of x against x @ weight.T + b in float64: at most one bf16 step
    apart; each row alone bitwise that row in every batch."""
    alone = [product(x[i:i + 1]) for i in range(8)]
    for rows in range(1, 9):
        out = product(x[:rows])
        ref = x[:rows].double() @ weight.T + b.double()
        assert ((out.double() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-4).all(), rows
        for i in range(rows):
            assert torch.equal(alone[i].view(torch.int16), out[i:i + 1].view(torch.int16))


def _build(name: str, march: str, folder):
    from torch.utils.cpp_extension import load
    return load(name=name, sources=[str(fast_decode.SOURCE)], build_directory=str(folder),
                extra_cflags=["-O3", f"-march={march}", "-fopenmp"], extra_ldflags=["-fopenmp"],
                verbose=False)


@pytest.fixture(scope="module")
def avx2_build(built, tmp_path_factory):
    """The extension built for a CPU with AVX2 and FMA but not AVX512 (most laptops):
    `-march=haswell`, whatever this one has."""
    if not {"avx2", "fma"} <= fast_decode.cpu_flags():
        pytest.skip("this CPU cannot run an AVX2 build")
    return _build("apprentice_decode_avx2_test", "haswell", tmp_path_factory.mktemp("avx2"))


def test_the_avx2_loop_is_a_matmul_and_a_row_alone_is_a_row_in_a_batch(avx2_build, monkeypatch,
                                                                       tmp_path):
    """The AVX2 build runs the AVX2 loops of `dot_rows` and `dot_lanes`. The same checks as
    above on that build, for bf16 weights and int8 copies: near x @ w.T + b in float64, a row
    alone bitwise itself in a batch; then its decode steps against its Python step."""
    ext = avx2_build
    for width in (40, 256, 1000):
        g = torch.Generator().manual_seed(width)
        w = torch.randn(37, width, generator=g).bfloat16()
        b = torch.randn(37, generator=g).bfloat16()
        x = torch.randn(8, width, generator=g).bfloat16()
        q = torch.randint(-127, 128, (37, width), dtype=torch.int8, generator=g)
        scale = torch.rand(37, generator=g) / 64
        _check_rows(lambda xs: ext.rows_linear(xs, w, b), w.double(), x, b)
        _check_rows(lambda xs: ext.int8_rows(xs, q, scale, b),
                    q.double() * scale.double()[:, None], x, b)
    # the whole step on that build (x rows widened to fp32, the loops without AVX512): the
    # direct step and the tensor one against the Python step, which calls the same build
    monkeypatch.setattr(fast_decode, "_ext", ext)
    for family in COVERED:
        model = load_model(save_hf_checkpoint(family, tmp_path / family), dtype="bfloat16")
        for direct in ("1", "0"):
            _check_steps(monkeypatch, model, direct)


@pytest.fixture(scope="module")
def portable_build(built, tmp_path_factory):
    """The extension without vector instructions past x86-64's (`-march=x86-64`)."""
    return _build("apprentice_decode_portable_test", "x86-64",
                  tmp_path_factory.mktemp("portable"))


def test_the_avx2_loops_give_the_portable_loops_bits(avx2_build, portable_build):
    """Without AVX2 (`-march=x86-64`) the extension runs scalar loops; with it, the same
    arithmetic 8 lanes at a time: the products' lanes summed in registers (`lane_sums8`),
    attention's exp (`exp8_ps` against `exp_one`), its scaling and its weighted values. Their
    outputs are the same bits: matmuls of 1-8 rows, bf16 weights and int8 copies (widths whole
    blocks of 16 or not; 1-4 rows in streams), and attention decoding and prefilling, causal or
    masked, over 1-300 keys, with head sizes of 8-lane blocks and not."""
    portable = portable_build
    g = torch.Generator().manual_seed(5)

    def same(a, b):
        return torch.equal(a.view(torch.int16), b.view(torch.int16))

    # 37 and 301 outputs: 1-4 rows of x take them in streams (`row_streams`: one row in four
    # runs of 8 and 74 rows, two to four rows in two runs) and the rest one after another
    for outputs, width in ((37, 16), (37, 40), (37, 64), (37, 256), (301, 256)):
        w = torch.randn(outputs, width, generator=g).bfloat16()
        b = torch.randn(outputs, generator=g).bfloat16()
        q = torch.randint(-127, 128, (outputs, width), generator=g, dtype=torch.int8)
        scale = torch.rand(outputs, generator=g) * 0.02                 # int8 copies likewise
        for rows in range(1, 9):
            x = torch.randn(rows, width, generator=g).bfloat16()
            assert same(avx2_build.rows_linear(x, w, b), portable.rows_linear(x, w, b)), width
            assert same(avx2_build.int8_rows(x, q, scale, b), portable.int8_rows(x, q, scale, b))
    for kv, group, new, cols, dim in [(2, 2, 1, 1, 64), (2, 2, 1, 300, 64), (1, 3, 1, 77, 20),
                                      (2, 1, 19, 19, 64), (2, 2, 7, 150, 64), (1, 2, 5, 40, 48)]:
        for masked in (False, True):
            q = torch.randn(2, kv, group, new, dim, generator=g).bfloat16() * 3
            k = torch.randn(2, kv, cols, dim, generator=g).bfloat16()
            v = torch.randn(2, kv, cols, dim, generator=g).bfloat16()
            mask = None
            if masked:
                mask = torch.rand(2, new, cols, generator=g) > 0.3
                mask[:, :, -1] = True
            args = (q, k, v, mask, not masked, dim ** -0.5)
            assert same(avx2_build.attention_rows(*args), portable.attention_rows(*args)), \
                (kv, group, new, cols, dim, masked)


def test_the_training_kernels_on_avx2_and_without(avx2_build, portable_build):
    """The training kernels (`rope_rows_backward`, `rms_norm_rows_backward`, `token_logprobs`
    and its backward) in the AVX2 and the portable builds against this CPU's: the rotary
    embedding's gradient the same bits (each product and sum rounded as autograd rounds
    them), RMSNorm's gradients and the log-probabilities equal to fp32 rounding (their sums
    run in another order)."""
    native = fast_decode.extension()
    g = torch.Generator().manual_seed(7)
    grad = torch.randn(2, 6, 13, 64, generator=g).bfloat16()
    angles = torch.randn(2, 13, 32, generator=g)
    cos, sin = (torch.cat((f(angles), f(angles)), -1).bfloat16() for f in (torch.cos, torch.sin))
    x = torch.randn(300, 64, generator=g).bfloat16()
    w = (torch.rand(6, 64, generator=g) + 0.5).bfloat16()
    gx = torch.randn(300, 64, generator=g).bfloat16()
    logits = (4 * torch.randn(9, 1000, generator=g)).bfloat16()
    target = torch.randint(0, 1000, (9,), generator=g)
    temps = torch.rand(9, generator=g) + 0.3
    up = torch.randn(9, generator=g)
    ref_rope = native.rope_rows_backward(grad, cos, sin)
    ref_dx, ref_dw = native.rms_norm_rows_backward(gx, x, w, 1e-6)
    ref_lp, ref_lse = native.token_logprobs(logits, target, temps)
    ref_dl = native.token_logprobs_backward(up, logits, target, temps, ref_lse)
    for ext in (avx2_build, portable_build):
        assert torch.equal(ext.rope_rows_backward(grad, cos, sin), ref_rope)
        dx, dw = ext.rms_norm_rows_backward(gx, x, w, 1e-6)
        assert torch.allclose(dx.float(), ref_dx.float(), rtol=1e-2, atol=1e-2)
        assert torch.allclose(dw, ref_dw, rtol=1e-4, atol=1e-4)
        lp, lse = ext.token_logprobs(logits, target, temps)
        assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5)
        dl = ext.token_logprobs_backward(up, logits, target, temps, lse)
        assert torch.allclose(dl.float(), ref_dl.float(), rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [7, 100, 8192])
def test_sample_rows_draws_what_the_tensor_path_draws(built, dtype, vocab):
    """The fused sampler against `generate`'s tensor path on the same uniform numbers: greedy
    is argmax (the first of tied maxima) with log_softmax's logprob; sampled at temperature
    0.7 the same tokens (the inverse of the cumulative sum at u) and logprobs within fp32
    rounding; tokens at -inf are never drawn, and a row with no finite logit or with a NaN
    is refused."""
    from agent_runtime.model import generate as gen_mod
    ext = fast_decode.extension()
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(64, vocab, generator=g) * 3).to(dtype)
    logits[:, 3 % vocab] = -float("inf")
    logits[0, :] = 1.0                                       # ties: the first index wins
    tok, lp = ext.sample_rows(logits, 0.0)
    want = logits.float().argmax(-1)
    assert torch.equal(tok, want) and tok[0] == 0
    ref = logits.float().log_softmax(-1).gather(-1, want[:, None])[:, 0]
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-5)
    p = SamplingParams(temperature=0.7)
    for seed in range(5):
        u = torch.rand(64, generator=torch.Generator().manual_seed(seed))
        tok, lp = ext.sample_rows(logits, 0.7, u)
        want, want_lp = gen_mod._sample_with(logits.float(), p, u[:, None])
        assert torch.equal(tok, want), seed
        torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-5)
        assert not (tok[1:] == 3 % vocab).any()              # row 0: all ties, no -inf
    edge = torch.full((2, vocab), -float("inf"))
    edge[0, -1] = 0.0                                        # one token with all the mass
    assert ext.sample_rows(edge[:1], 1.0, torch.tensor([0.999]))[0].tolist() == [vocab - 1]
    with pytest.raises(RuntimeError, match="no finite maximum"):
        ext.sample_rows(edge, 1.0, torch.tensor([0.5, 0.5]))
    for col in (0, vocab - 1):                               # one NaN, in a block or the tail
        bad = logits[:2].clone()
        bad[1, col] = float("nan")
        for temperature in (0.0, 0.7):
            with pytest.raises(RuntimeError, match="no finite maximum"):
                ext.sample_rows(bad, temperature, torch.tensor([0.5, 0.5]))
    with pytest.raises(RuntimeError, match="one uniform number per row"):
        ext.sample_rows(logits, 1.0)


def test_generate_samples_through_the_fused_sampler_as_through_tensor_ops(
        built, monkeypatch, tmp_path):
    """`generate` with the fused sampler and with it switched off: the same tokens and
    logprobs within fp32 rounding, greedy and sampled (same seed), top-p on the tensor path."""
    from agent_runtime.model import generate as gen_mod
    model = load_model(save_hf_checkpoint("qwen3_moe", tmp_path / "m"), dtype="bfloat16")
    prompts = _prompts(9, 14, 5)
    real = gen_mod._fused_sampler
    for params in (SamplingParams(max_new_tokens=12),
                   SamplingParams(max_new_tokens=12, temperature=1.0, seed=4),
                   SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=4)):
        calls = []
        monkeypatch.setattr(gen_mod, "_fused_sampler",
                            lambda *a: calls.append(real(*a)) or calls[-1])
        fused = generate(model, prompts, params)
        monkeypatch.setattr(gen_mod, "_fused_sampler", lambda *a: None)
        plain = generate(model, prompts, params)
        assert all(c is not None for c in calls) == (params.top_p == 1.0) and calls
        for a, b in zip(fused, plain):
            assert a.tokens == b.tokens
            assert a.logprobs == pytest.approx(b.logprobs, rel=1e-5, abs=1e-5)


def test_the_amx_tiles_and_the_avx512_loop_agree(built, tmp_path):
    """On a CPU with AMX-BF16 the few-row products run on tiles (`amx_range`); with
    APPRENTICE_AMX=0 (read once a process, so in a second one) on the AVX512 loop. Both sum
    the same products in fp32 in another order, rounded once to bf16: at most one bf16 step
    apart (mostly the same bits)."""
    if not fast_decode.has_amx():
        pytest.skip("no AMX-BF16 on this CPU")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 256, generator=g).bfloat16(), torch.randn(300, 256, generator=g).bfloat16()
    torch.save((x, w), tmp_path / "xw.pt")
    script = ("import sys, torch; from agent_runtime.model import fast_decode; "
              "x, w = torch.load(sys.argv[1]); "
              "torch.save(fast_decode.extension().rows_linear(x, w, None), sys.argv[2])")
    subprocess.run([sys.executable, "-c", script, tmp_path / "xw.pt", tmp_path / "loop.pt"],
                   check=True, env={**os.environ, "APPRENTICE_AMX": "0"})
    loop = torch.load(tmp_path / "loop.pt")
    tiles = fast_decode.extension().rows_linear(x, w, None)
    assert ((tiles.double() - loop.double()).abs() <= loop.double().abs() * 2 ** -7 + 1e-4).all()


@pytest.mark.parametrize("rows,weights,width", [(1, 1, 256), (6, 6, 64), (40, 3, 100)])
def test_rms_norm_rows_is_rmsnorm_in_bf16(built, rows, weights, width):
    """`rms_norm_rows` against RMSNorm computed in float64 and rounded as HF rounds it
    (normalized value to bf16, then times the weight): at most one bf16 step apart; weight
    rows cycle over x's rows; a row alone gets its bits in the batch."""
    from agent_runtime.model.model import rms_normalize
    ext = fast_decode.extension()
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, width, generator=g) * 3).bfloat16()
    w = (torch.rand(weights, width, generator=g) + 0.5).bfloat16()
    out = ext.rms_norm_rows(x, w.squeeze(0) if weights == 1 else w, 1e-6)
    ref = w.double().repeat(rows // weights + 1, 1)[:rows] * rms_normalize(x.double(), 1e-6)
    assert ((out.double() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-6).all()
    for i in range(rows):
        one = ext.rms_norm_rows(x[i:i + 1], w[i % weights], 1e-6)
        assert torch.equal(one.view(torch.int16), out[i:i + 1].view(torch.int16))


def test_a_build_killed_midway_does_not_hang_the_next_one(tmp_path):
    """torch's `lock` file, left by a build that was killed, is removed under our flock (the
    next build would otherwise wait on it forever); while another process's build holds the
    flock, its `lock` is left alone and the next build waits for it to end."""
    folder = tmp_path / "ext"
    folder.mkdir()
    (folder / "lock").write_text("")
    with fast_decode.build_lock(folder):
        assert not (folder / "lock").exists()
        (folder / "lock").write_text("")             # a build in progress: ours
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"held\n"
        waiting = threading.Thread(target=lambda: fast_decode.build_lock(folder).__enter__())
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive() and (folder / "lock").exists()
    finally:
        holder.kill()                                # killed mid-build: the kernel frees it
        holder.wait()
    waiting.join(30)
    assert not waiting.is_alive() and not (folder / "lock").exists()


HOLD = """
import fcntl, sys, time
f = open(sys.argv[1] + "/apprentice.lock", "a+")
fcntl.flock(f, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


def test_builds_go_under_the_torch_extensions_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = fast_decode.build_directory("x")
    assert folder.parent.parent == tmp_path and torch.__version__ in folder.parent.name


def test_a_first_build_is_announced_and_a_compiled_one_is_not(tmp_path):
    assert not fast_decode.built(tmp_path, "x")
    if fast_decode.extension() is None:
        pytest.skip(f"the extension cannot be built here: {fast_decode._failed}")
    name = fast_decode.extension_name()
    assert fast_decode.built(fast_decode.build_directory(name), name)


def _relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("B,H,KV,T,D", [(1, 4, 2, 100, 64), (2, 4, 2, 130, 64),
                                        (1, 2, 2, 17, 32), (2, 8, 2, 300, 64)])
def test_training_attention_on_tiles_is_causal_sdpa_and_its_backward(built, B, H, KV, T, D):
    """`CausalAttention` (forward and backward in C++, on AMX tiles or with AVX512-BF16 dot
    products) against causal `scaled_dot_product_attention` in float64 from the same bf16
    inputs: the output and each gradient within 1 % of it, as close as PyTorch's own bf16
    kernel comes (its error at most twice that kernel's, plus 0.1 %)."""
    import torch.nn.functional as F

    from agent_runtime.model.model import CausalAttention
    if not fast_decode.extension().has_train_attention():
        pytest.skip("neither AMX-BF16 nor AVX512-BF16 on this CPU")
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(B, n, T, D, generator=g).bfloat16() for n in (H, KV, KV))
    grad = torch.randn(B, H, T, D, generator=g).bfloat16()

    def run(fn, dtype):
        leaves = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(grad.to(dtype))
        return [out.detach()] + [t.grad for t in leaves]

    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3,
                                                          enable_gqa=True)
    ref = run(sdpa, torch.float64)
    theirs = run(sdpa, torch.bfloat16)
    ours = run(lambda q, k, v: CausalAttention.apply(q, k, v, 0.3), torch.bfloat16)
    for mine, bf16, exact in zip(ours, theirs, ref):
        assert mine.dtype == torch.bfloat16 and mine.shape == exact.shape
        assert _relative(mine, exact) < min(0.01, 2 * _relative(bf16, exact) + 1e-3)


def test_training_attention_over_spans_computes_only_their_queries_with_the_same_bits(built):
    """`CausalAttention` with `spans` (a packed prefix tree's paths, `Paths`): inside row b's
    span [first, end) the output and dq are bitwise those of the whole computation when the
    gradient outside the spans is 0 (what a path's shared or padded places get), and dk, dv
    too; from `end` on, 0."""
    from agent_runtime.model.model import CausalAttention
    if not fast_decode.extension().has_train_attention():
        pytest.skip("neither AMX-BF16 nor AVX512-BF16 on this CPU")
    B, H, KV, T, D = 3, 4, 2, 150, 64
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, n, T, D, generator=g).bfloat16() for n in (H, KV, KV))
    spans = torch.tensor([[0, 150], [37, 120], [150, 150]])
    inside = torch.zeros(B, 1, T, 1, dtype=torch.bool)
    after = torch.zeros(B, 1, T, 1, dtype=torch.bool)
    for b, (first, end) in enumerate(spans.tolist()):
        inside[b, :, first:end] = True
        after[b, :, end:] = True
    grad = torch.randn(B, H, T, D, generator=g).bfloat16() * inside

    def run(*extra):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = CausalAttention.apply(*leaves, 0.3, *extra)
        out.backward(grad)
        return [out.detach()] + [t.grad for t in leaves]

    whole, part = run(), run(spans)
    for a, b in zip(whole[:2], part[:2]):                    # out and dq
        assert torch.equal(b * inside, a * inside) and not (b * after).any()
    for a, b in zip(whole[2:], part[2:]):                    # dk and dv
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="span"):
        CausalAttention.apply(q, k, v, 0.3, torch.tensor([[0, 151]] * B))


def test_a_packed_prefix_tree_trains_as_its_rows(built, tmp_path, monkeypatch):
    """Rows that start alike fed once as a packed tree (`Paths`): every place of every row
    gets the logits the rows fed apart give it, and the gradients match, in fp32 (PyTorch's
    attention) and in bf16 (`CausalAttention` over the paths' spans), to the dtype's
    rounding."""
    from agent_runtime.model import model as mm
    from agent_runtime.model.model import Paths
    path = save_hf_checkpoint("qwen3_moe", tmp_path / "m", head_dim=32)
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, VOCAB, (3, 70), generator=g)
    rows[1, :40] = rows[0, :40]                  # row 1 shares 40 places with row 0,
    rows[2, :55] = rows[1, :55]                  # row 2 55 with row 1
    lengths = [70, 64, 70]
    # the packed tree: row 0, then row 1 from place 40, row 2 from place 55
    nodes = [torch.arange(70), torch.cat([torch.arange(40), 70 + torch.arange(24)]),
             torch.cat([torch.arange(40), 70 + torch.arange(15), 94 + torch.arange(15)])]
    N = 109
    ids, positions = torch.zeros(N, dtype=torch.long), torch.zeros(N, dtype=torch.long)
    index = torch.zeros(3, 70, dtype=torch.long)
    take = torch.full((N,), -1)
    for r, (nd, n) in enumerate(zip(nodes, lengths)):
        ids[nd], positions[nd] = rows[r, :n], torch.arange(n)
        index[r, :n], index[r, n:] = nd, nd[-1]
        new = take[nd] < 0
        take[nd[new]] = r * 70 + torch.arange(n)[new]
    spans = torch.tensor([[0, 70], [40, 64], [55, 70]])
    calls = []
    apply = mm.CausalAttention.apply
    monkeypatch.setattr(mm.CausalAttention, "apply", lambda *a: calls.append(a[4:]) or apply(*a))
    for dtype, tol in (("float32", 1e-5), ("bfloat16", 0.03)):
        grads, logits = [], []
        for packed in (False, True):
            model = load_model(path, dtype=dtype)
            if packed:
                out = model(ids[None], positions=positions[None],
                            paths=Paths(index, take, spans)).logits[0]
                got = [out[nd] for nd in nodes]
            else:
                out = model(rows).logits
                got = [out[r, :n] for r, n in enumerate(lengths)]
            logits.append(torch.cat(got).float())
            logits[-1].log_softmax(-1).max(-1).values.sum().backward()
            grads.append(torch.cat([p.grad.double().flatten() for p in model.parameters()]))
        assert (logits[0] - logits[1]).abs().max() < tol * logits[0].abs().max()
        assert _relative(grads[1], grads[0]) < tol
    if fast_decode.extension().has_train_attention():
        assert any(c and torch.equal(c[0], spans) for c in calls)


def test_a_bf16_model_trains_through_the_tiles(built, tmp_path, monkeypatch):
    """A bf16 model's training gradients go through `CausalAttention` where it serves, and
    land as close to the fp32 model's as with PyTorch's kernel."""
    from agent_runtime.model import model as mm
    if not fast_decode.extension().has_train_attention():
        pytest.skip("neither AMX-BF16 nor AVX512-BF16 on this CPU")
    path = save_hf_checkpoint("qwen3_moe", tmp_path / "m", head_dim=32)   # the tiles' K: 32 k
    ids = torch.randint(0, VOCAB, (2, 90), generator=torch.Generator().manual_seed(0))
    calls = []
    apply = mm.CausalAttention.apply
    monkeypatch.setattr(mm.CausalAttention, "apply", lambda *a: calls.append(1) or apply(*a))

    def grads(dtype, tiles):
        monkeypatch.setattr(mm, "TRAIN_ATTENTION", tiles)
        model = load_model(path, dtype=dtype)
        logits = model(ids).logits.float()
        logits.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).mean().backward()
        return torch.cat([p.grad.double().flatten() for p in model.parameters()])

    exact = grads("float32", False)
    pytorch = grads("bfloat16", False)
    assert not calls
    tiles = grads("bfloat16", True)
    assert len(calls) == load_model(path).args.num_layers
    assert _relative(tiles, exact) < 2 * _relative(pytorch, exact) + 1e-3
