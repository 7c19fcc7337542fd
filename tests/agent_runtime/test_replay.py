"""Router replay: recorded routes reproduce behaviour logprobs and pin experts after updates."""

import pytest
import torch

from agent_runtime.model import load_model
from agent_runtime.model.generate import SamplingParams, generate
from tiny_checkpoints import FAMILIES, VOCAB, save_hf_checkpoint


def _sequence_logprobs(model, prompt, gen, routes=None):
    ids = torch.tensor([prompt + gen.tokens[:-1]])
    out = model(ids, routes=None if routes is None else routes[None].long())
    lp = out.logits[0, len(prompt) - 1:].float().log_softmax(-1)
    return lp.gather(-1, torch.tensor(gen.tokens)[:, None])[:, 0], out.routes[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_reproduces_generation_logprobs_and_routes(family, tmp_path):
    model = load_model(save_hf_checkpoint(family, tmp_path), dtype="float32")
    prompt = torch.randint(0, VOCAB, (23,), generator=torch.Generator().manual_seed(5)).tolist()
    gen = generate(model, [prompt], SamplingParams(max_new_tokens=40, temperature=1.0, seed=1))[0]
    with torch.no_grad():
        lp, routes = _sequence_logprobs(model, prompt, gen, gen.routes)
    assert (lp - torch.tensor(gen.logprobs)).abs().max().item() < 1e-5
    assert torch.equal(routes, gen.routes.long())                 # 100 % route agreement


def _perturbed(model, scale, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.abs().mean())


def test_after_a_weight_update_routes_flip_without_replay_not_with(tmp_path):
    model = load_model(save_hf_checkpoint("qwen2_moe", tmp_path), dtype="float32")
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    gen = generate(model, [prompt], SamplingParams(max_new_tokens=40, temperature=1.0, seed=2))[0]
    _perturbed(model, 0.05)
    with torch.no_grad():
        _, free = _sequence_logprobs(model, prompt, gen)
        _, replayed = _sequence_logprobs(model, prompt, gen, gen.routes)
    flips = (free.sort(-1).values != gen.routes.long().sort(-1).values).any(-1).float().mean().item()
    assert flips > 0.01, "the perturbation should move some tokens to other experts"
    assert torch.equal(replayed, gen.routes.long())


def test_gradients_reach_the_router_under_replay(tmp_path):
    model = load_model(save_hf_checkpoint("mixtral", tmp_path), dtype="float32")
    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(7)).tolist()
    gen = generate(model, [prompt], SamplingParams(max_new_tokens=8, temperature=1.0, seed=3))[0]
    lp, _ = _sequence_logprobs(model, prompt, gen, gen.routes)
    lp.sum().backward()
    for i, block in enumerate(model.layers):
        grad = block.mlp.gate.weight.grad
        assert grad is not None and grad.abs().sum() > 0, f"no router gradient at layer {i}"
        assert block.mlp.experts.gate_up.grad.abs().sum() > 0
