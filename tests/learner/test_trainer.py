"""The GRPO trainer on tiny real checkpoints: router replay exactness, updates, versions,
metrics, checkpoints and resume, and reward rising on a trivially learnable task family."""

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent_runtime"))
from tiny_checkpoints import save_tiny_agent_checkpoint  # noqa: E402

from agent_runtime import delta  # noqa: E402
from agent_runtime.model import load_model  # noqa: E402
from agent_runtime.policies import load_policy  # noqa: E402
from agent_runtime.store import SessionStore  # noqa: E402
from learner import pipeline  # noqa: E402
from learner.config import (OptimConfig, PipelineConfig, RolloutConfig, RunConfig,  # noqa: E402
                            TrainerConfig)
from learner.grpo import TrainSample, token_weights  # noqa: E402
from learner.trainer import Trainer  # noqa: E402
from learner.versions import VersionStore  # noqa: E402

PROMPTS = ["Fix calc.py so that add() adds.", "List the files.", "Say hello.", "Run the tests."]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["qwen2_moe", "granitemoe"])
def ckpt(request, tmp_path_factory):
    return save_tiny_agent_checkpoint(tmp_path_factory.mktemp("ckpt"), family=request.param)


def rollouts(ckpt, dtype="float32", n=4, tokens=12, seed=0) -> list[TrainSample]:
    policy = load_policy(str(ckpt), dtype=dtype, temperature=1.0, max_new_tokens=tokens)
    torch.manual_seed(seed)
    out = []
    for i in range(n):
        c = policy.complete([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
        out.append(TrainSample(c.prompt_ids, c.completion_ids, c.logprobs, c.routes, c.version,
                               advantage=1.0 if i % 2 else -1.0))
    return out


def trainer(ckpt, run_dir, **kw) -> Trainer:
    config = TrainerConfig(optim=OptimConfig(lr=1e-2), **kw)
    return Trainer(load_model(ckpt, dtype=torch.float32), run_dir, config)


def test_replay_reproduces_behaviour_logprobs_on_policy(ckpt, tmp_path):
    samples = rollouts(ckpt)
    t = trainer(ckpt, tmp_path)
    for s in samples:
        out = t.forward(s, replay=True)
        assert out.logprobs.dtype == torch.float32
        assert (out.logprobs - torch.tensor(s.logprobs)).abs().max() < 1e-5
        assert out.flips == 0 and out.routed == s.routes.shape[0] * s.routes.shape[1]
    m = t.measure(samples)
    assert m["flip_rate"] == 0.0 and m["max_logprob_diff"] < 1e-5 and m["kl"] < 1e-9


def test_behaviour_kl_leaves_out_the_tokens_the_call_grammar_chose(ckpt, tmp_path):
    """A forced token was not sampled from the behaviour policy, so its ratio says nothing
    about how far the two models are: marked forced, an off logprob there leaves the KL and
    the largest difference at those of the sampled tokens; unmarked, it dominates both."""
    samples = rollouts(ckpt, n=2)
    t = trainer(ckpt, tmp_path)
    off = [replace(s, logprobs=[*s.logprobs[:-1], s.logprobs[-1] - 8.0]) for s in samples]
    forced = [replace(s, forced=(s.n_tokens - 1,)) for s in off]
    m = t.measure(forced)
    assert m["kl"] < 1e-9 and m["max_logprob_diff"] < 1e-5
    m = t.measure(off)
    assert m["kl"] > 1.0 and m["max_logprob_diff"] > 7.9


@pytest.mark.parametrize("temperature", [0.0, 0.6])
def test_samples_recorded_at_any_temperature_train_against_their_own_logprobs(
        ckpt, tmp_path, temperature):
    """Recorded through the agent loop and the store, a sample keeps the temperature its
    logprobs were taken at; the trainer (configured for another) reproduces them exactly."""
    from agent_runtime.agent import Agent, AgentConfig
    policy = load_policy(str(ckpt), dtype="float32", temperature=temperature, max_new_tokens=10)
    store = SessionStore(tmp_path / "home")
    torch.manual_seed(0)
    Agent(policy, store=store, workspace=tmp_path, config=AgentConfig(max_steps=2)).run("Say hi.")
    rows = store.samples(store.list_sessions(1)[0]["id"])
    assert rows and all(r["temperature"] == temperature for r in rows)
    t = trainer(ckpt, tmp_path / "run", temperature=1.3)
    for r in rows:
        sample = TrainSample(r["prompt_ids"], r["completion_ids"], r["logprobs"], r["routes"],
                             r["policy_version"], advantage=1.0, temperature=r["temperature"])
        out = t.forward(sample, replay=True)
        assert (out.logprobs - torch.tensor(r["logprobs"])).abs().max() < 1e-5
        unscaled = t.forward(replace(sample, temperature=None), replay=True)   # at the configured 1.3
        assert (unscaled.logprobs - torch.tensor(r["logprobs"])).abs().max() > 1e-3
    store.close()


def test_replay_forces_the_recorded_experts(ckpt, tmp_path):
    s = rollouts(ckpt, n=1)[0]
    t = trainer(ckpt, tmp_path)
    E = t.model.args.num_experts
    other = ((s.routes.astype(np.int64) + 1) % E).astype(np.uint8)     # a different expert
    forced = TrainSample(**{**s.__dict__, "routes": other})
    replayed = t.forward(forced, replay=True)
    tokens = s.routes.shape[0]
    # at the first MoE layer the input is the rollout's, so its router would choose the
    # recorded experts, never the forced ones: every token flips there (later layers see
    # other hidden states and may or may not agree)
    assert tokens <= replayed.flips <= replayed.routed
    assert (replayed.logprobs - torch.tensor(s.logprobs)).abs().max() > 1e-3
    free = t.forward(forced, replay=False)                    # no replay: routes ignored
    assert (free.logprobs - torch.tensor(s.logprobs)).abs().max() < 1e-5


def ragged(samples: list[TrainSample]) -> list[TrainSample]:
    """The rollouts cut to different completion lengths (a generation's prefix is a sample too),
    on top of their different prompt lengths."""
    out = []
    for i, s in enumerate(samples):
        t, P = max(1, len(s.completion_ids) - 2 * i), len(s.prompt_ids)
        out.append(TrainSample(s.prompt_ids, s.completion_ids[:t], s.logprobs[:t],
                               s.routes[:P + t - 1], s.version, s.advantage))
    return out


def perturb(model, seed=1, scale=0.05):
    """Move the weights off the behaviour policy so ratios, flips and clipping all show up."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale * p.abs().mean())


@pytest.mark.parametrize("replay", [True, False])
def test_batched_forward_equals_one_by_one(ckpt, tmp_path, replay):
    samples = ragged(rollouts(ckpt, n=6))
    assert len({len(s.prompt_ids) for s in samples}) > 1
    assert len({len(s.completion_ids) for s in samples}) > 1
    t = trainer(ckpt, tmp_path)
    perturb(t.model)
    batched = t.forward_batch(samples, replay=replay)
    single = [t.forward(s, replay=replay) for s in samples]
    for b, o, s in zip(batched, single, samples):
        assert b.logprobs.shape == (len(s.completion_ids),)
        assert (b.logprobs - o.logprobs).abs().max() < 1e-5
        assert (b.flips, b.routed) == (o.flips, o.routed)
    assert sum(o.flips for o in single) > 0                   # the flip counts were exercised


def test_batched_forward_mixes_samples_with_and_without_routes(ckpt, tmp_path):
    samples = ragged(rollouts(ckpt))
    samples[1] = TrainSample(**{**samples[1].__dict__, "routes": None})
    t = trainer(ckpt, tmp_path)
    perturb(t.model)
    batched = t.forward_batch(samples, replay=True)
    single = [t.forward(s, replay=True) for s in samples]
    for b, o in zip(batched, single):
        assert (b.logprobs - o.logprobs).abs().max() < 1e-5
        assert (b.flips, b.routed) == (o.flips, o.routed)
    assert batched[1].routed == 0 and batched[0].routed > 0


def conversation(ckpt, calls=3, tokens=8, seed=0) -> list[TrainSample]:
    """The model calls of one conversation: each prompt is the previous prompt, its
    completion and a tool result, as the agent loop feeds them."""
    policy = load_policy(str(ckpt), dtype="float32", temperature=1.0, max_new_tokens=tokens)
    torch.manual_seed(seed)
    prompt = policy.tokenizer.encode(PROMPTS[0])
    out = []
    for i in range(calls):
        g = policy.generate(prompt, tokens)
        out.append(TrainSample(list(prompt), g.tokens, g.logprobs, np.asarray(g.routes),
                               policy.version, advantage=1.0))
        prompt = list(prompt) + g.tokens + policy.tokenizer.encode(f"\nresult {i}\n")
    return out


@pytest.mark.parametrize("replay", [True, False])
def test_the_calls_of_one_conversation_share_a_row(ckpt, tmp_path, replay):
    from learner.trainer import _fed_len, _rows
    chain = conversation(ckpt)
    other = rollouts(ckpt, n=1, seed=3)[0]
    samples = [chain[0], other, chain[1], chain[2]]
    assert _rows(samples) == [[0, 2, 3], [1]]
    first = _fed_len(chain[0])
    assert np.array_equal(chain[1].routes[:first], chain[0].routes)   # one prefix, one route
    t = trainer(ckpt, tmp_path)
    perturb(t.model)
    packed = t.forward_batch(samples, replay=replay)
    single = [t.forward(s, replay=replay) for s in samples]
    for b, o, s in zip(packed, single, samples):
        assert b.logprobs.shape == (len(s.completion_ids),)
        assert (b.logprobs - o.logprobs).abs().max() < 1e-5
    L = chain[0].routes.shape[1]
    assert [packed[i].routed for i in (0, 2, 3)] == [
        first * L, (_fed_len(chain[1]) - first) * L, (_fed_len(chain[2]) - _fed_len(chain[1])) * L]
    assert packed[1].routed == single[1].routed                # a position counts once
    assert sum(o.flips for o in packed) <= sum(o.flips for o in single)
    batches = t.micro_batches(samples)
    assert sorted(len(b) for b in batches) in ([1, 3], [4])    # the conversation stays together
    assert any(len(b) >= 3 and all(c in b for c in chain) for b in batches)


def group(ckpt, episodes=4, tokens=8) -> list[TrainSample]:
    """A GRPO group's model calls: every episode's first call answers one prompt; two
    episodes repeat another's first call token for token (as a sharp policy does) and
    differ in the second; the rest sample their own first call."""
    policy = load_policy(str(ckpt), dtype="float32", temperature=1.0, max_new_tokens=tokens)
    prompt = policy.tokenizer.encode(PROMPTS[0])
    out = []
    for e in range(episodes):
        torch.manual_seed(0 if e < 2 else e)               # episodes 0 and 1 share call 1
        g = policy.generate(prompt, tokens)
        out.append(TrainSample(list(prompt), g.tokens, g.logprobs, np.asarray(g.routes),
                               policy.version, advantage=1.0 if e % 2 else -1.0))
        nxt = list(prompt) + g.tokens + policy.tokenizer.encode(f"\nresult {e}\n")
        torch.manual_seed(100 + e)
        g = policy.generate(nxt, tokens)
        out.append(TrainSample(nxt, g.tokens, g.logprobs, np.asarray(g.routes),
                               policy.version, advantage=1.0 if e % 2 else -1.0))
    return out


@pytest.mark.parametrize("replay", [True, False])
def test_rows_that_start_alike_are_fed_once_with_the_values_of_rows_fed_apart(
        ckpt, tmp_path, replay):
    from learner.trainer import _rows, _tree
    samples = group(ckpt)
    rows = _rows(samples)
    assert len(rows) == 4                                   # one row per episode
    feeds = [np.asarray(samples[r[-1]].prompt_ids + samples[r[-1]].completion_ids[:-1])[:, None]
             for r in rows]
    nodes, n = _tree(feeds)
    assert n < sum(map(len, feeds)) - 3 * len(samples[0].prompt_ids)   # more than the prompt
    shared = len(samples[0].prompt_ids) + len(samples[0].completion_ids)
    assert samples[2].completion_ids == samples[0].completion_ids       # episode 1: call 1 of
    assert np.array_equal(nodes[1][:shared], nodes[0][:shared])         # episode 0, fed once
    results, grads = [], []
    for share in (True, False):
        t = trainer(ckpt, tmp_path / str(share), share_prefixes=share)
        perturb(t.model)
        results.append(t.forward_batch(samples, replay=replay))
        single = [t.forward(s, replay=replay) for s in samples]
        t.step(samples)
        grads.append({k: p.grad for k, p in t.model.named_parameters()})
    for a, b, o in zip(*results, single):
        assert (a.logprobs - b.logprobs).abs().max() < 1e-5
        assert (a.logprobs - o.logprobs).abs().max() < 1e-5
        assert (a.flips, a.routed) == (b.flips, b.routed)   # counted per row either way
    for k, g in grads[1].items():
        torch.testing.assert_close(grads[0][k], g, rtol=1e-4, atol=1e-7)
    # where episodes part, one packed position predicts two different tokens
    assert len({s.completion_ids[0] for s in samples[::2]}) > 1


def test_a_position_scored_for_several_tokens_gives_each_its_logprob():
    from agent_runtime.model import token_logprobs
    from learner.trainer import _token_logprobs
    torch.manual_seed(0)
    logits = torch.randn(3, 11, requires_grad=True)
    rows = torch.tensor([0, 0, 1, 2, 2, 2])
    target = torch.tensor([1, 2, 3, 4, 4, 5])
    temps = torch.tensor([1.0, 1.0, 0.5, 1.0, 0.7, 1.0])
    got = _token_logprobs(logits, rows, target, temps)
    want = token_logprobs(logits[rows], target, temps)
    torch.testing.assert_close(got, want)
    g, = torch.autograd.grad(got.sum(), logits)
    w, = torch.autograd.grad(want.sum(), logits)
    torch.testing.assert_close(g, w)


def test_a_prefix_is_shared_only_with_the_routes_it_was_fed_with(ckpt, tmp_path):
    from learner.trainer import _tree
    a = np.array([[5, 1, 2], [6, 3, 4], [7, 1, 2]])
    b = a.copy()
    b[1, 2] = 0                                             # another expert at position 1
    nodes, n = _tree([a, b])
    assert n == 3 + 2 and list(nodes[1]) == [0, 3, 4]
    assert _tree([a, a.copy()])[1] == 3 and _tree([a, a.copy()], share=False)[1] == 6
    samples = group(ckpt)[:4]
    moved = samples[2].routes.copy()                        # episode 1 fed with other experts
    moved[0] = (moved[0] + 1) % 4
    samples[2] = replace(samples[2], routes=moved)
    outs = []
    for share in (True, False):
        t = trainer(ckpt, tmp_path / str(share), share_prefixes=share)
        perturb(t.model)
        outs.append(t.forward_batch(samples, replay=True))
    for a, b in zip(*outs):
        assert (a.logprobs - b.logprobs).abs().max() < 1e-5


@pytest.mark.parametrize("share", [True, False])
def test_micro_batches_respect_the_token_budget(ckpt, tmp_path, share):
    from learner.trainer import _tree
    samples = ragged(rollouts(ckpt, n=6))
    fed = [len(s.prompt_ids) + len(s.completion_ids) - 1 for s in samples]
    budget = 2 * max(fed)
    t = trainer(ckpt, tmp_path, micro_batch_tokens=budget, share_prefixes=share)
    batches = t.micro_batches(samples)
    assert sorted(map(id, sum(batches, []))) == sorted(map(id, samples))
    assert 1 < len(batches) < len(samples)
    for batch in batches:
        feeds = [np.asarray(s.prompt_ids + s.completion_ids[:-1])[:, None] for s in batch]
        assert _tree(feeds, share)[1] <= budget             # positions fed, a shared one once
        assert len(batch) * max(map(len, feeds)) <= 2 * budget   # padded rows (attention)
    t.config.micro_batch_tokens = 1                            # every sample alone
    assert [len(b) for b in t.micro_batches(samples)] == [1] * len(samples)


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_step_gradient_does_not_depend_on_the_micro_batch_size(ckpt, tmp_path, kl_coef):
    samples = ragged(rollouts(ckpt, n=6))
    grads, rows = [], []
    for budget in (1, 1 << 20):                    # one sample per micro-batch vs one for all
        config = TrainerConfig(optim=OptimConfig(lr=1e-2), micro_batch_tokens=budget)
        config.loss.kl_coef = kl_coef
        t = Trainer(load_model(ckpt, dtype=torch.float32), tmp_path / str(budget), config)
        perturb(t.model)
        rows.append(t.step(samples))
        grads.append({n: p.grad for n, p in t.model.named_parameters()})
    assert all(g is not None and g.abs().sum() > 0 for g in grads[0].values())
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-4, atol=1e-7)
    for key in ("loss", "kl", "flip_rate", "clip_frac", "ref_kl", "grad_norm"):
        assert rows[1][key] == pytest.approx(rows[0][key], rel=1e-4, abs=1e-9), key
    assert rows[0]["flip_rate"] > 0 and (kl_coef == 0 or rows[0]["ref_kl"] > 0)


def test_tokens_the_grammar_chose_carry_no_loss_when_the_advantage_is_negative(ckpt, tmp_path):
    """A negative sample's forced tokens add nothing (lowering them would raise the model's
    own draw, the call that could not run); a positive sample's are learned as any other.
    So the step on both equals the step on the positive one alone, scaled by its share of
    the batch's tokens (the token-level mean's denominator counts every token)."""
    negative, positive = rollouts(ckpt, n=2, seed=1)
    assert negative.advantage < 0 < positive.advantage
    every = lambda s: TrainSample(**{**s.__dict__, "forced": tuple(range(s.n_tokens))})
    grads = []
    for batch in ([every(negative), every(positive)], [positive]):
        t = Trainer(load_model(ckpt, dtype=torch.float32), tmp_path / str(len(batch)),
                    TrainerConfig(optim=OptimConfig(lr=1e-2, grad_clip=0.0)))   # grads as computed
        t.step(batch)
        grads.append({n: p.grad for n, p in t.model.named_parameters() if p.grad is not None})
    share = positive.n_tokens / (positive.n_tokens + negative.n_tokens)
    assert grads[0].keys() == grads[1].keys() and grads[1]
    for n, g in grads[1].items():
        torch.testing.assert_close(grads[0][n], g * share, rtol=1e-3, atol=1e-6)
    partial = TrainSample(**{**negative.__dict__, "forced": (0, negative.n_tokens - 1)})
    assert token_weights([positive, partial]).tolist() == (
        [1.0] * positive.n_tokens + [0.0] + [1.0] * (negative.n_tokens - 2) + [0.0])


def test_negatives_may_train_only_the_decision(ckpt, tmp_path):
    """negatives="decision": a disliked call's tokens after its tool name carry no loss (a
    sample without a known decision keeps all of them); liked calls are untouched."""
    from agent_runtime.model import load_tokenizer
    from learner.grpo import decision_end
    tok = load_tokenizer(ckpt)
    text = 'Fixing it.\n<tool_call>\n{"name": "edit_file", "arguments": {"path": "a.py"}}'
    ids = tok.encode(text)
    k = decision_end(tok, ids)
    assert '"edit_file"' in tok.decode(ids[:k]) and '"edit_file"' not in tok.decode(ids[:k - 1])
    assert decision_end(tok, tok.encode("No call here.")) is None
    neg = TrainSample(ids[:2], ids, [-1.0] * len(ids), None, 1, advantage=-1.0, decision=k)
    pos = TrainSample(ids[:2], ids, [-1.0] * len(ids), None, 1, advantage=1.0, decision=k)
    unknown = TrainSample(ids[:2], ids, [-1.0] * len(ids), None, 1, advantage=-1.0)
    n = len(ids)
    assert token_weights([neg, pos, unknown], "decision").tolist() == (
        [1.0] * k + [0.0] * (n - k) + [1.0] * n + [1.0] * n)
    assert token_weights([neg, pos, unknown]).tolist() == [1.0] * (3 * n)
    with pytest.raises(ValueError, match="negatives"):
        token_weights([neg], "some")


def test_balance_weighs_the_disliked_tokens_that_train_as_much_as_the_liked():
    """balance_scale: sum of |advantage| x weight of the negative tokens that train equals the
    positive tokens' once they are scaled by it; one side alone is left as it is."""
    from learner.grpo import balance_scale
    ids = list(range(10, 30))
    neg = TrainSample(ids[:2], ids, [-1.0] * 20, None, 1, advantage=-0.5, decision=4,
                      forced=(1,))
    pos = TrainSample(ids[:2], ids[:6], [-1.0] * 6, None, 1, advantage=1.5)
    zero = TrainSample(ids[:2], ids[:3], [-1.0] * 3, None, 1, advantage=0.0)
    batch = [pos, neg, zero]
    for negatives, live in (("all", 19), ("decision", 3)):
        scale = balance_scale(batch, negatives)
        assert scale == pytest.approx(1.5 * 6 / (0.5 * live))
        w = token_weights(batch, negatives, scale)
        assert w[:6].tolist() == [1.0] * 6 and w[26:].tolist() == [1.0] * 3
        assert float(w[6:26].sum()) * 0.5 == pytest.approx(1.5 * 6)
        assert w[7] == 0.0 and (negatives == "all" or w[6 + 4:26].sum() == 0)
    assert balance_scale([neg, zero]) == balance_scale([pos]) == 1.0


def test_loop_positions_are_the_repeats_of_a_looping_tail():
    from learner.grpo import loop_positions
    head = [5, 9, 2, 7, 11]
    looping = head + [3, 4, 8] * 12                        # period 3: its first copy is not a repeat
    assert loop_positions(looping) == tuple(range(len(head) + 3, len(looping)))
    assert loop_positions(head * 3 + [1, 2, 3, 4]) == ()   # the tail does not repeat
    assert loop_positions(head + [6] * 10) == ()           # a short run: not a loop
    assert loop_positions([]) == ()


@pytest.mark.parametrize("weight", [0.0, 1.0])
def test_unlikelihood_lowers_the_tokens_of_a_loop(ckpt, tmp_path, weight):
    """A loop's tokens are near-certain, where the policy gradient vanishes: the
    unlikelihood term (LossConfig.unlikelihood) lowers them even with no advantage at all,
    and only them: a sample without loop positions moves nothing."""
    from learner.config import LossConfig
    [sample] = rollouts(ckpt, n=1, tokens=16)
    t = trainer(ckpt, tmp_path, loss=LossConfig(unlikelihood=weight))
    loop = TrainSample(**{**sample.__dict__, "advantage": 0.0,
                          "loop": tuple(range(4, sample.n_tokens))})
    before = t.forward(loop).logprobs[4:].clone()
    t.step([loop])
    after = t.forward(loop).logprobs[4:]
    if weight:
        assert after.mean() < before.mean()
    else:
        assert torch.equal(after, before)


def test_bf16_compute_trains_the_fp32_masters(ckpt, tmp_path):
    """precision="bf16": forwards and backwards on a bf16 copy, gradients added to the fp32
    masters per micro-batch, the copy refreshed after every change of the masters."""
    samples = ragged(rollouts(ckpt, n=6))
    ref = trainer(ckpt, tmp_path / "fp32")
    perturb(ref.model)
    t = trainer(ckpt, tmp_path / "bf16", precision="bf16")
    t.model.load_state_dict(ref.model.state_dict())          # the copy follows (in place)
    assert t.bf16 and t.net() is not t.model and t.net().lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(t.net().lm_head.weight, ref.model.lm_head.weight.bfloat16())
    want = torch.cat([ref.forward(s).logprobs for s in samples])
    got = torch.cat([t.forward(s).logprobs for s in samples])
    assert got.dtype == torch.float32 and (got - want).abs().max() < 0.1
    grads = []
    for group in t.optimizer.param_groups:
        group["lr"] = 0.0                                    # the gradient only, no change
    # no clipping: a ratio near a clip boundary falls on either side of it in bf16 depending on
    # the padding, which switches that token's whole gradient on or off
    t.config.loss.eps_low, t.config.loss.eps_high, t.config.loss.ratio_cap = 1e9, 1e9, 2e9
    for budget in (1, 1 << 20):
        t.config.micro_batch_tokens = budget
        t.step(samples)
        grads.append({n: p.grad.clone() for n, p in t.model.named_parameters()})
    a, b = (torch.cat([g[n].flatten() for n in sorted(g)]) for g in grads)
    assert a.dtype == torch.float32 and a.abs().sum() > 0
    assert (a - b).norm() < 0.05 * a.norm()                  # bf16 rounding, not a bug
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    for group in t.optimizer.param_groups:
        group["lr"] = 1e-2
    t.step(samples)
    changed = [k for k, v in t.model.state_dict().items() if not torch.equal(v, before[k])]
    assert "lm_head.weight" in changed and all(v.dtype == torch.float32 for v in
                                               t.model.state_dict().values())
    assert torch.equal(t.net().lm_head.weight, t.model.lm_head.weight.bfloat16())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_only_the_trainable_weights_change(ckpt, tmp_path, precision):
    """`trainable`: the parameters whose names match train; the others keep their loaded
    values exactly, the bf16 working copy's included (its gradients must not reach them)."""
    samples = rollouts(ckpt)
    t = trainer(ckpt, tmp_path, precision=precision, trainable=(r"\.mlp\.experts\.",))
    before = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    t.step(samples)
    changed = {k for k, v in t.model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(".mlp.experts." in k for k in changed)
    assert "lm_head.weight" not in changed and not any("self_attn" in k for k in changed)
    with pytest.raises(ValueError, match="no parameter name matches"):
        trainer(ckpt, tmp_path / "none", trainable=("no_such_weight",))


def test_router_gets_gradient_under_replay(ckpt, tmp_path):
    t = trainer(ckpt, tmp_path)
    t.step(rollouts(ckpt, n=2))
    gates = [b.mlp.gate.weight for b in t.model.layers if b.is_moe]
    assert gates and all(g.grad is not None and g.grad.abs().sum() > 0 for g in gates)


def test_step_changes_parameters_and_publishes_a_bf16_version(ckpt, tmp_path):
    versions = VersionStore(tmp_path / "versions")
    store = SessionStore(tmp_path / "home")
    t, extra = Trainer.open(ckpt, tmp_path / "run", TrainerConfig(optim=OptimConfig(lr=1e-2)),
                            versions, store)
    assert extra is None and t.version == 1                   # the initial weights
    before = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    row = t.step(rollouts(ckpt))
    assert row["updated"] == 1 and t.version == 2 and row["version"] == 2
    changed = [k for k, v in t.model.state_dict().items() if not torch.equal(v, before[k])]
    assert any("gate.weight" in k for k in changed) and "lm_head.weight" in changed
    published = versions.state(2)
    assert all(v.dtype == torch.bfloat16 for v in published.values())
    assert delta.state_sha256(published) == delta.state_sha256(t.published_state())
    assert [v["version"] for v in store.policy_versions()] == [1, 2]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_iterations_are_optimizer_steps_on_one_batch_against_its_behaviour(ckpt, tmp_path,
                                                                            precision):
    """Two passes in one step end where two steps on the same samples do (the ratio to the
    recorded behaviour logprobs, not to the first pass's), but publish one version."""
    samples = rollouts(ckpt, n=6)
    one = trainer(ckpt, tmp_path / "one", iterations=2, precision=precision)
    apart = trainer(ckpt, tmp_path / "apart", precision=precision)
    row = one.step(samples)
    rows = [apart.step(samples), apart.step(samples)]
    for name, weight in one.model.state_dict().items():
        assert torch.equal(weight, apart.model.state_dict()[name]), name
    assert one.step_count == 1 and one.version == 1 and apart.version == 2
    assert row["iterations"] == 2 and rows[0]["iterations"] == 1
    for key in ("kl", "flip_rate", "grad_norm"):         # the first pass's
        assert row[key] == rows[0][key], key
    for key in ("loss", "ratio_mean", "clip_frac"):      # the last pass's
        assert row[key] == rows[1][key], key
    assert rows[0]["clip_frac"] == 0 < rows[1]["clip_frac"]     # the second pass's moved


def test_an_empty_batch_skips_the_update(ckpt, tmp_path):
    t = trainer(ckpt, tmp_path)
    t.publish()
    before = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    row = t.step([])
    assert row["updated"] == 0 and t.version == 1 and t.step_count == 1
    assert all(torch.equal(v, before[k]) for k, v in t.model.state_dict().items())


def test_metrics_are_a_row_per_step_in_sqlite(ckpt, tmp_path):
    t = trainer(ckpt, tmp_path)
    t.publish()
    samples = rollouts(ckpt)
    t.step(samples, {"reward_mean": 0.5})
    t.step(samples, {"reward_mean": 0.75})
    rows = t.metrics()
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["reward_mean"] == 0.75
    assert rows[0]["flip_rate"] == 0.0 and rows[0]["kl"] < 1e-9   # step 1 is on-policy
    assert rows[1]["kl"] > rows[0]["kl"]                          # step 2 is one update behind
    t.log_metrics({**rows[1], "reward_mean": 0.1})                # a step redone after resume
    assert [r["reward_mean"] for r in t.metrics()] == [0.5, 0.1]


def test_resume_continues_exactly_where_the_checkpoint_left_off(ckpt, tmp_path):
    samples = rollouts(ckpt)
    versions = VersionStore(tmp_path / "versions")
    config = TrainerConfig(optim=OptimConfig(lr=1e-2), keep_checkpoints=2)
    a, _ = Trainer.open(ckpt, tmp_path / "run", config, versions)
    for _ in range(3):
        a.step(samples, extra_state={"cursor": 7})
    assert [p.name for p in a.checkpoints()] == ["step-00000002.pt", "step-00000003.pt"]
    b, extra = Trainer.open(ckpt, tmp_path / "run", config, versions)
    assert extra == {"cursor": 7} and b.step_count == 3 and b.version == a.version == 4
    for k, v in a.model.state_dict().items():
        assert torch.equal(v, b.model.state_dict()[k])
    a.step(samples)
    b.step(samples)                                       # same update from the same state
    for k, v in a.model.state_dict().items():
        assert torch.equal(v, b.model.state_dict()[k])
    assert versions.latest().version == 5                 # b's identical state: no new version


def test_reward_rises_on_a_trivially_learnable_family(tmp_path):
    ckpt = save_tiny_agent_checkpoint(tmp_path / "ckpt")
    config = RunConfig(model=str(ckpt), tasks="toy",
                       trainer=TrainerConfig(optim=OptimConfig(lr=2e-2)),
                       rollout=RolloutConfig(group_size=8, max_new_tokens=8),
                       pipeline=PipelineConfig(mode="sync", steps=10, groups_per_step=2))
    pipe = pipeline.build(config, tmp_path / "run", SessionStore(tmp_path / "home"))
    before = {k: v.detach().clone() for k, v in pipe.trainer.model.state_dict().items()}
    rows = []
    pipe.run(on_step=rows.append)
    rewards = [r["reward_mean"] for r in rows]
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.15, rewards
    assert rows[0]["updated"] and rows[-1]["version"] > rows[0]["version"]
    changed = sum(not torch.equal(v, before[k]) for k, v in pipe.trainer.model.state_dict().items())
    assert changed > len(before) // 2


def test_optional_kl_penalty_keeps_a_frozen_reference(ckpt, tmp_path):
    config = TrainerConfig(optim=OptimConfig(lr=1e-2))
    config.loss.kl_coef = 0.1
    t = Trainer(load_model(ckpt, dtype=torch.float32), tmp_path, config)
    t.publish()
    samples = rollouts(ckpt, n=2)
    first, second = t.step(samples), t.step(samples)
    assert first["ref_kl"] == pytest.approx(0.0, abs=1e-9)    # model == reference at step 1
    assert second["ref_kl"] > 0
    assert all(not p.requires_grad for p in t.ref.parameters())


def test_an_off_policy_sample_trains_at_ratio_one_whatever_logprobs_it_carries(ckpt, tmp_path):
    """A guide's call (`TrainSample.off_policy`: the oracle wrote it, no policy sampled it)
    carries zeros for logprobs; the trainer takes its own, detached, as the behaviour's, so
    the step equals the step on the same tokens recorded with exactly the trainer's
    logprobs: A * d log p per token, unclipped. Read as an on-policy sample, the zeros would
    give another step. It adds nothing to the behaviour KL, which has no behaviour to measure."""
    sample = replace(rollouts(ckpt, n=2, seed=2)[1], routes=None)
    assert sample.advantage > 0
    zeros = replace(sample, logprobs=[0.0] * sample.n_tokens)
    probe = Trainer(load_model(ckpt, dtype=torch.float32), tmp_path / "probe", TrainerConfig())
    perturb(probe.model)
    with torch.no_grad():
        own = probe.forward(sample).logprobs.tolist()
    grads, rows = [], []
    for name, s in (("guide", replace(zeros, off_policy=True)),
                    ("own", replace(sample, logprobs=own)), ("zeros", zeros)):
        t = Trainer(load_model(ckpt, dtype=torch.float32), tmp_path / name,
                    TrainerConfig(optim=OptimConfig(lr=1e-2, grad_clip=0.0)))
        perturb(t.model)
        rows.append(t.step([s]))
        grads.append({n: p.grad for n, p in t.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n, g in grads[1].items():
        torch.testing.assert_close(grads[0][n], g, rtol=1e-4, atol=1e-7)
    assert any(not torch.allclose(grads[2][n], g, rtol=1e-2, atol=1e-5) for n, g in grads[1].items())
    assert np.isnan(rows[0]["kl"]) and not np.isnan(rows[1]["kl"])
