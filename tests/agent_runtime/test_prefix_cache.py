"""Prefix caching: a call that continues an earlier one reuses its keys, values and routes and
gives what a fresh prefill gives (tokens, logprobs, routes), alone or in a ragged batch."""

import pytest
import torch

from agent_runtime.model.generate import SamplingParams, generate
from agent_runtime.model.prefix_cache import PrefixCache
from agent_runtime.policies import load_policy
from tiny_checkpoints import save_tiny_agent_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_agent_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def model(ckpt):
    return load_policy(str(ckpt), prefix_cache_mb=0).model


GREEDY = SamplingParams(max_new_tokens=10)


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 600, (n,), generator=g).tolist()


def same(a, b):
    assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
    assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) < 1e-4
    assert a.routes.shape == b.routes.shape and torch.equal(a.routes, b.routes)


def replays(model, p: list[int], g) -> float:
    """Max |logprob| gap between a full forward with the recorded routes and `g`."""
    ids = torch.tensor([p + g.tokens[:-1]])
    with torch.no_grad():
        out = model(ids, routes=g.routes.long()[None])
    lp = out.logits[0, len(p) - 1:].float().log_softmax(-1)
    lp = lp.gather(-1, torch.tensor(g.tokens)[:, None])[:, 0]
    return (lp - torch.tensor(g.logprobs)).abs().max().item()


def test_a_continued_conversation_reuses_the_prefix_and_matches_a_fresh_prefill(model):
    cache = PrefixCache()
    p1 = prompt(0, 40)
    g1 = generate(model, [p1], GREEDY, prefix_cache=cache)[0]
    p2 = p1 + g1.tokens + prompt(1, 15)            # answer + a tool result
    g2 = generate(model, [p2], GREEDY, prefix_cache=cache)[0]
    assert cache.hits == 1 and cache.reused_tokens == len(p1) + len(g1.tokens) - 1
    same(g2, generate(model, [p2], GREEDY)[0])
    assert g2.routes.shape[0] == len(p2) + len(g2.tokens) - 1
    assert replays(model, p2, g2) < 1e-5


def test_a_ragged_batch_with_and_without_hits_matches_fresh_prefills(model):
    cache = PrefixCache()
    a, b = prompt(2, 30), prompt(3, 12)
    first = generate(model, [a, b], GREEDY, prefix_cache=cache)
    rows = [a + first[0].tokens + prompt(4, 7),       # long hit
            b[:6] + prompt(5, 20),                    # partial hit: 6 shared tokens
            prompt(6, 9)]                             # miss
    got = generate(model, rows, GREEDY, prefix_cache=cache)
    for p, g in zip(rows, got):
        same(g, generate(model, [p], GREEDY)[0])
        assert replays(model, p, g) < 1e-5


def test_a_prompt_equal_to_a_cached_one_still_feeds_its_last_token(model):
    cache = PrefixCache()
    p = prompt(7, 25)
    generate(model, [p], GREEDY, prefix_cache=cache)
    again = generate(model, [p], GREEDY, prefix_cache=cache)[0]
    assert cache.reused_tokens == len(p) - 1
    same(again, generate(model, [p], GREEDY)[0])


def test_entries_are_evicted_least_recently_used_beyond_max_bytes(model):
    cache = PrefixCache()
    generate(model, [prompt(8, 50)], GREEDY, prefix_cache=cache)
    one = cache.entries[0].nbytes
    cache.max_bytes = int(one * 2.5)
    for s in range(9, 13):
        generate(model, [prompt(s, 50)], GREEDY, prefix_cache=cache)
    assert len(cache.entries) == 2 and cache.nbytes <= cache.max_bytes
    assert cache.entries[-1].ids[:50].tolist() == prompt(12, 50)


def test_a_continuation_replaces_the_entry_it_extends(model):
    cache = PrefixCache()
    p1 = prompt(13, 20)
    g1 = generate(model, [p1], GREEDY, prefix_cache=cache)[0]
    generate(model, [p1 + g1.tokens + [7, 8, 9]], GREEDY, prefix_cache=cache)
    assert len(cache.entries) == 1


def test_swapping_weights_clears_the_engine_policys_cache(ckpt):
    policy = load_policy(str(ckpt), temperature=0.0, max_new_tokens=8)
    messages = [{"role": "user", "content": "Fix calc.py so that add() adds."}]
    policy.complete(messages)
    assert policy.prefix_cache.entries
    policy.swap_state(lambda state: state["lm_head.weight"].mul_(-1.0), version=1)
    assert not policy.prefix_cache.entries
    after = policy.complete(messages)
    fresh = load_policy(str(ckpt), temperature=0.0, max_new_tokens=8, prefix_cache_mb=0)
    fresh.swap_state(lambda state: state["lm_head.weight"].mul_(-1.0), version=1)
    assert after.completion_ids == fresh.complete(messages).completion_ids


def test_prefix_cache_mb_zero_turns_it_off(ckpt):
    policy = load_policy(str(ckpt), temperature=0.0, max_new_tokens=4, prefix_cache_mb=0)
    policy.complete([{"role": "user", "content": "Hi."}])
    policy.complete([{"role": "user", "content": "Hi."}])
    assert policy.prefix_cache.entries == [] and policy.prefix_cache.hits == 0


def test_rows_that_begin_alike_prefill_their_common_prefix_once(model):
    cache = PrefixCache()
    head = prompt(14, 60)
    rows = [head, head, head + prompt(15, 5), head[:50] + prompt(16, 8)]   # common: 50 tokens
    got = generate(model, rows, GREEDY, prefix_cache=cache)
    assert cache.shared_prefills == 1
    assert cache.reused_tokens == 4 * 50
    for p, g in zip(rows, got):
        same(g, generate(model, [p], GREEDY)[0])
        assert replays(model, p, g) < 1e-5
    group = [head + prompt(17, 3)] * 3        # 63 shared tokens, 60 of them cached: no prefill
    generate(model, group, GREEDY, prefix_cache=cache)
    assert cache.shared_prefills == 1


def test_stop_strings_with_the_prefix_cache_on_match_an_uncached_generation(ckpt):
    policy = load_policy(str(ckpt), temperature=0.0)
    fresh = load_policy(str(ckpt), temperature=0.0, prefix_cache_mb=0)
    ids = policy.tokenizer.encode("def add(a, b):\n    return a + b\n")
    policy.generate(ids, max_new_tokens=16, stop=["\n"])
    assert policy.prefix_cache.entries
    again = policy.generate(ids, max_new_tokens=16, stop=["\n"])
    want = fresh.generate(ids, max_new_tokens=16, stop=["\n"])
    assert policy.prefix_cache.hits == 1
    assert (again.tokens, again.finish_reason, again.text) == (want.tokens, want.finish_reason, want.text)


def test_when_the_padded_layout_would_overflow_rows_keep_what_fits_of_their_prefix(model):
    cache = PrefixCache()
    a = prompt(2, 60)
    ga = generate(model, [a], GREEDY, prefix_cache=cache)[0]
    a2 = a + ga.tokens + prompt(3, 5)              # 69 of its tokens cached
    b = prompt(4, 40)                              # none of them
    budget = model.args.max_position - len(a2)     # as much as the longer prompt allows:
    calls = {"n": 0}                               # 69 cached + 40 new + budget overflow

    def three():
        calls["n"] += 1
        return calls["n"] > 3

    widths = []
    forward = model.forward

    def spy(ids, *args, **kw):
        widths.append(ids.shape[1])
        return forward(ids, *args, **kw)

    model.forward = spy
    try:
        got = generate(model, [a2, b], SamplingParams(max_new_tokens=budget),
                       prefix_cache=cache, should_stop=three)
    finally:
        del model.forward
    assert widths[0] == len(b)                     # not len(a2): a2 fed 40, reused 35
    calls["n"] = 0
    fresh = generate(model, [a2, b], SamplingParams(max_new_tokens=budget), should_stop=three)
    for g, f in zip(got, fresh):
        same(g, f)
