"""Weight-only int8 for decode steps (`--quantize int8`): what reads the copies, what does not,
the C++ step's bits, weight swaps, and the behaviour logprobs of the weights that served."""

import pytest
import torch

from agent_runtime.model import fast_decode, load_model
from agent_runtime.model.generate import SamplingParams, generate
from agent_runtime.model.quantize import int8_weight, quantize
from agent_runtime.policies import load_policy
from tiny_checkpoints import VOCAB, save_hf_checkpoint, save_tiny_agent_checkpoint


def _prompts(*lens):
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]


def test_int8_weights_round_each_row_to_its_own_scale():
    w = torch.randn(3, 48, 64) * torch.tensor([0.01, 1.0, 30.0])[:, None, None]
    w[1, 5] = 0                                                    # a row of zeros
    q, scale = int8_weight(w)
    assert q.dtype == torch.int8 and scale.shape == (3, 48)
    assert int(q.abs().max()) == 127 and not q[1, 5].any()
    err = (q.float() * scale.unsqueeze(-1) - w).abs()
    assert bool((err <= scale.unsqueeze(-1) / 2 + 1e-7).all())      # half a step at most
    with pytest.raises(ValueError, match="unknown mode 'int4'"):
        quantize(torch.nn.Module(), "int4")


@pytest.mark.parametrize("K", [48, 256, 200])
def test_int8_rows_is_the_matmul_and_a_row_alone_is_a_row_in_a_batch(K):
    ext = fast_decode.extension()
    if ext is None:
        pytest.skip(f"no C++ toolchain here: {fast_decode._failed}")
    g = torch.Generator().manual_seed(K)
    q, scale = int8_weight(torch.randn(70, K, generator=g).bfloat16())
    x = torch.randn(8, K, generator=g).bfloat16()
    b = torch.randn(70, generator=g).bfloat16()
    y = ext.int8_rows(x, q, scale, b)
    want = x.double() @ (q.double() * scale.double()[:, None]).T + b.double()
    assert y.dtype == torch.bfloat16
    assert torch.allclose(y.double(), want, rtol=2 ** -7, atol=1e-4)   # one bf16 rounding
    for m in range(8):                                                # bits of the row alone
        assert torch.equal(ext.int8_rows(x[m:m + 1], q, scale, b), y[m:m + 1])
        assert torch.equal(ext.int8_rows(x[m:m + 3], q, scale, b)[0], y[m])


def test_decode_rows_read_the_copies_and_prefill_reads_the_weights(tmp_path):
    path = save_hf_checkpoint("qwen3_moe", tmp_path / "m")
    with pytest.raises(ValueError, match="serve bfloat16 models, this one is float32"):
        quantize(load_model(path, dtype="float32"))
    dtype = "bfloat16"
    full, q8 = load_model(path, dtype=dtype), quantize(load_model(path, dtype=dtype))
    experts = q8.layers[0].mlp.experts                               # hidden 48, expert width
    assert experts.q[0] is not None and experts.q[2] is None         # 24: no copy of `down`
    assert q8.state_dict().keys() == full.state_dict().keys()       # the copies are not state
    assert all(torch.equal(a, b) for a, b in zip(q8.state_dict().values(),
                                                 full.state_dict().values()))
    with torch.no_grad():
        long_ids, short_ids = torch.tensor(_prompts(20)), torch.tensor(_prompts(5))
        assert torch.equal(full(long_ids).logits, q8(long_ids).logits)   # 20 rows: full weights
        a, b = full(short_ids).logits.float(), q8(short_ids).logits.float()
    assert not torch.equal(a, b)                                     # 5 rows: the int8 copies
    assert (a - b).abs().max() < 0.05 * a.abs().max()                # ... close to the weights
    with torch.enable_grad():                                        # a gradient: never
        ids = torch.tensor(_prompts(5))
        assert torch.equal(q8(ids).logits, full(ids).logits)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen3_moe+width32"])
def test_the_cpp_step_reads_the_copies_with_the_python_steps_bits(monkeypatch, tmp_path,
                                                                  family):
    dtype = "bfloat16"
    if fast_decode.extension() is None:
        pytest.skip(f"no C++ toolchain here: {fast_decode._failed}")
    over = {"moe_intermediate_size": 32} if family.endswith("width32") else {}
    path = save_hf_checkpoint(family.split("+")[0], tmp_path / "m", **over)
    model = quantize(load_model(path, dtype=dtype))
    assert fast_decode.stepper(model) is not None
    assert (model.layers[0].mlp.experts.q[2] is not None) == bool(over)   # down's copy
    for prompts, params in [(_prompts(13), SamplingParams(max_new_tokens=16)),
                            (_prompts(5, 17, 11), SamplingParams(max_new_tokens=12)),
                            (_prompts(9, 9, 9, 9, 9, 9, 9, 9, 9),    # 9 rows: full weights
                             SamplingParams(max_new_tokens=8, temperature=1.0, seed=3))]:
        out = {}
        for mode, direct in (("0", "1"), ("1", "0"), ("1", "1")):   # Python, tensor, direct
            monkeypatch.setenv(fast_decode.ENV, mode)
            monkeypatch.setenv(fast_decode.DIRECT, direct)
            out[mode + direct] = generate(model, prompts, params)
        for a, b, c in zip(out["01"], out["10"], out["11"]):
            assert a.tokens == b.tokens == c.tokens and a.logprobs == b.logprobs == c.logprobs
            assert torch.equal(a.routes, b.routes) and torch.equal(a.routes, c.routes)
    full = generate(load_model(path, dtype=dtype), _prompts(13), SamplingParams(max_new_tokens=16))
    q8 = generate(model, _prompts(13), SamplingParams(max_new_tokens=16))
    assert full[0].logprobs != q8[0].logprobs                       # the step read the copies


def test_a_quantized_policy_records_the_logprobs_of_what_served_and_swaps_weights(tmp_path):
    path = save_tiny_agent_checkpoint(tmp_path / "a")
    messages = [{"role": "user", "content": "Fix calc.py so that add() adds."}]
    kw = dict(temperature=1.0, seed=0, max_new_tokens=12, dtype="bfloat16")
    full, q8 = load_policy(str(path), **kw), load_policy(str(path), quantize="int8", **kw)
    c = q8.complete(messages)
    assert c.logprobs != full.complete(messages).logprobs
    # each decoded token's logprob is the quantized model's on one row (the rows a decode
    # step feeds): recompute them token by token from the prompt's cache
    model = q8.model
    with torch.no_grad():
        cache = model.new_cache(1, len(c.prompt_ids) + len(c.completion_ids))
        logits = model(torch.tensor([c.prompt_ids]), cache=cache, logits_to_keep=1).logits
        for tok, lp in zip(c.completion_ids, c.logprobs):
            want = logits[0, -1].float().log_softmax(-1)[tok].item()
            assert abs(want - lp) < 1e-5
            logits = model(torch.tensor([[tok]]), cache=cache).logits
    # a swap to other weights makes the copies again: the policy then decodes what a model
    # holding those weights, quantized, does
    state = {k: v * 1.25 for k, v in q8.model.state_dict().items()}
    q8.load_state(state, version=3)
    fresh = load_model(path, dtype="bfloat16")
    fresh.load_state_dict(state)
    prompt = [c.prompt_ids]
    a = generate(q8.model, prompt, SamplingParams(max_new_tokens=8))[0]
    b = generate(quantize(fresh), prompt, SamplingParams(max_new_tokens=8))[0]
    assert a.tokens == b.tokens and a.logprobs == b.logprobs
