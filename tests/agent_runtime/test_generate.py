"""Generation: ragged batches, sampling controls, behaviour logprobs, stops, seeds, streaming."""

import math
import random

import pytest
import torch

from agent_runtime.model import fast_decode, load_model
from agent_runtime.model.generate import (LoopGuard, SamplingParams, _draw, _filter_logprobs,
                                          generate, prefill_groups)
from tiny_checkpoints import VOCAB, save_hf_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(save_hf_checkpoint("qwen3_moe", tmp_path_factory.mktemp("m")), dtype="float32")


def prompts(*lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]


def test_ragged_batch_equals_one_by_one(model):
    ps = prompts(5, 17, 11)
    batch = generate(model, ps, SamplingParams(max_new_tokens=12))
    for p, g in zip(ps, batch):
        single = generate(model, [p], SamplingParams(max_new_tokens=12))[0]
        assert g.tokens == single.tokens
        assert max(abs(a - b) for a, b in zip(g.logprobs, single.logprobs)) < 1e-4
        assert torch.equal(g.routes, single.routes)


def test_same_seed_same_tokens_other_seed_differs(model):
    p = prompts(9)
    sp = dict(max_new_tokens=24, temperature=1.5)
    a = generate(model, p, SamplingParams(seed=7, **sp))[0].tokens
    b = generate(model, p, SamplingParams(seed=7, **sp))[0].tokens
    c = generate(model, p, SamplingParams(seed=8, **sp))[0].tokens
    assert a == b and a != c


def test_row_seeds_give_a_row_the_draws_it_gets_alone(tmp_path):
    """With `row_seeds` each row samples from a stream of its own, so its tokens do not depend
    on the rows beside it (bf16: every row's logits are bitwise its own); one seed for the
    batch shares its draws out in row order, and a row's tokens depend on its place."""
    m = load_model(save_hf_checkpoint("qwen3_moe", tmp_path / "m"), dtype="bfloat16")
    a, b, c = prompts(9, 9, 9, seed=3)
    sp = dict(max_new_tokens=20, temperature=1.5)
    alone = generate(m, [a], SamplingParams(row_seeds=[11], **sp))[0].tokens
    pair = generate(m, [b, a], SamplingParams(row_seeds=[12, 11], **sp))
    trio = generate(m, [c, b, a], SamplingParams(row_seeds=[13, 12, 11], **sp))
    assert pair[1].tokens == alone == trio[2].tokens and pair[0].tokens == trio[1].tokens
    assert generate(m, [b, a], SamplingParams(seed=11, **sp))[1].tokens != alone
    with pytest.raises(ValueError, match="row seeds"):
        generate(m, [a, b], SamplingParams(row_seeds=[1], **sp))


def test_behaviour_logprob_is_under_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    lp = _filter_logprobs(logits, SamplingParams(temperature=0.5, top_k=3))
    assert math.isinf(lp[0, 3]) and math.isinf(lp[0, 4])
    assert torch.allclose(lp[0, :3], (logits[0, :3] / 0.5).log_softmax(-1))
    lp = _filter_logprobs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    kept = torch.isfinite(lp[0])
    assert kept.tolist() == [True, True, False, False, False]   # p(0)=0.61 < 0.7 <= p(0)+p(1)
    assert abs(lp[0, kept].exp().sum().item() - 1) < 1e-6


def _uniform(n, seed):
    return torch.rand(n, 1, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fused", [False, True])
def test_draws_follow_the_distribution_and_never_take_a_token_without_mass(fused):
    """`_draw` (the tensor path) and the extension's fused `sample_rows` on the same
    distributions, given as log-probabilities to the latter."""
    ext = fast_decode.extension() if fused else None
    if fused and ext is None:
        pytest.skip(f"no C++ toolchain here: {fast_decode._failed}")

    def draw(probs, u):
        return ext.sample_rows(probs.log(), 1.0, u[:, 0])[0] if fused else _draw(probs, u)
    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0])
    tokens = draw(probs.repeat(100_000, 1), _uniform(100_000, 0))
    freq = torch.bincount(tokens, minlength=6).float() / len(tokens)
    assert freq[[0, 2, 5]].tolist() == [0.0, 0.0, 0.0]
    assert torch.allclose(freq, probs, atol=0.01)                 # ~7 standard errors
    one = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0]])               # every uniform, top included
    assert draw(one.repeat(1000, 1), _uniform(1000, 1)).eq(2).all()
    short = torch.tensor([[0.25, 0.75 - 1e-7, 0.0]])              # a total just under 1
    assert draw(short.repeat(1000, 1), _uniform(1000, 2)).lt(2).all()


def test_sampled_tokens_respect_top_k(model):
    p = prompts(6)
    g = generate(model, p, SamplingParams(max_new_tokens=20, temperature=1.0, top_k=1, seed=3))[0]
    greedy = generate(model, p, SamplingParams(max_new_tokens=20))[0]
    assert g.tokens == greedy.tokens
    assert all(abs(x) < 1e-6 for x in g.logprobs)              # one token left: probability 1


def test_stop_token_ends_a_row_and_is_kept(model):
    p = prompts(8)
    free = generate(model, p, SamplingParams(max_new_tokens=16))[0].tokens
    stop = free[5]
    first = free.index(stop)
    g = generate(model, p, SamplingParams(max_new_tokens=16, stop_token_ids=[stop]))[0]
    assert g.tokens == free[:first + 1] and g.finish_reason == "eos"
    assert len(g.routes) == len(p[0]) + len(g.tokens) - 1


def test_stop_string_truncates_text(model):
    decode = lambda ids: "".join(chr(65 + i % 26) for i in ids)
    p = prompts(8)
    free = generate(model, p, SamplingParams(max_new_tokens=16), decode=decode)[0]
    needle = free.text[6:8]
    g = generate(model, p, SamplingParams(max_new_tokens=16, stop=[needle]), decode=decode)[0]
    assert g.finish_reason == "stop"
    assert g.text == free.text[:free.text.index(needle)]


def test_streaming_callback_sees_every_token_in_order(model):
    seen = []
    g = generate(model, prompts(4, 7), SamplingParams(max_new_tokens=10),
                 on_token=lambda row, tok, lp: seen.append((row, tok)))
    for row in (0, 1):
        assert [t for r, t in seen if r == row] == g[row].tokens


def test_cancel_stops_generation(model):
    count = {"n": 0}

    def stop():
        count["n"] += 1
        return count["n"] > 3
    g = generate(model, prompts(5), SamplingParams(max_new_tokens=50), should_stop=stop)[0]
    assert g.finish_reason == "cancelled" and len(g.tokens) == 3


def test_context_window_is_enforced(model):
    with pytest.raises(ValueError, match="context window"):
        generate(model, prompts(10), SamplingParams(max_new_tokens=model.args.max_position))


def _first_loop(tokens, span):
    guard = LoopGuard(span)
    return next((i + 1 for i, t in enumerate(tokens) if guard.push(t)), None)


def test_loop_guard_ends_at_the_span_for_short_periods():
    assert _first_loop([5] * 20, 8) == 8                           # `in in in ...`
    assert _first_loop([1, 2, 9, 7, 7, 3] + [4, 5, 6] * 10, 12) == 6 + 12
    assert _first_loop(list(range(200)), 8) is None                # nothing repeats
    assert _first_loop([1, 2, 3, 4] * 2 + [9] * 3, 8) is None      # 2 periods are not a loop
    assert _first_loop([1, 2, 3, 4] * 3, 8) == 12                  # a 3rd period is
    too_long = list(range(LoopGuard.LONG_PERIOD + 1))
    assert _first_loop(too_long * 4, 8) is None                    # period too long to count
    assert _first_loop([1, 1, 1, 2] * 5, 6) == 3 * 4               # runs restart on a break


def test_loop_guard_ends_long_periods_at_their_third_copy():
    rng = random.Random(0)
    sentence = [rng.randrange(1000) for _ in range(40)]       # a sentence said again and again
    assert _first_loop(sentence * 5, 48) == 3 * 40
    assert _first_loop([7, 8] + sentence * 5, 48) == 2 + 3 * 40
    assert _first_loop(sentence * 2 + [rng.randrange(1000, 2000) for _ in range(300)], 48) is None
    just = list(range(LoopGuard.MAX_PERIOD + 1))                 # the first long period
    assert _first_loop(just * 4, 8) == 3 * len(just)
    # a piece of the sentence occurring twice in it first suggests a shorter period
    echo = sentence[:10] + sentence[:4] + sentence[14:]
    assert 3 * 40 <= _first_loop(echo * 5, 48) <= 3 * 40 + LoopGuard.GRAM
    # code whose lines differ by a number or a name is not a loop
    lines = [t for i in range(30) for t in (11, 12, 13, 100 + i, 14, 15, 16, 17, 18, 19, 20,
                                            21, 22, 23, 24, 25, 26, 27, 28, 200 + i)]
    assert _first_loop(lines, 48) is None


def test_a_looping_row_ends_with_finish_loop(tmp_path):
    looping = load_model(save_hf_checkpoint("qwen3_moe", tmp_path), dtype="float32")
    with torch.no_grad():
        looping.norm.weight.zero_()               # every logit 0: greedy repeats token 0
    p = prompts(6)
    free = generate(looping, p, SamplingParams(max_new_tokens=30))[0]
    assert free.tokens == [0] * 30 and free.finish_reason == "length"
    g = generate(looping, p, SamplingParams(max_new_tokens=30, loop_span=8))[0]
    assert g.tokens == [0] * 8 and g.finish_reason == "loop"
    assert len(g.routes) == len(p[0]) + 8 - 1


def test_on_done_hands_each_row_over_as_it_ends(model):
    ps = prompts(6, 9, 4)
    seen, handed = {"n": 0}, []

    def count(row, token, logprob):
        seen["n"] += row == 0                     # row 0 runs to the token limit

    def stop_row_1():
        return seen["n"] >= 3

    g = generate(model, ps, SamplingParams(max_new_tokens=20), on_token=count,
                 row_should_stop=[None, stop_row_1, None],
                 on_done=lambda row, gen: handed.append((row, seen["n"], gen)))
    rows = [row for row, _, _ in handed]
    assert sorted(rows) == [0, 1, 2] and rows.index(1) < rows.index(0)
    early = next(n for row, n, _ in handed if row == 1)
    assert early < 20                             # handed over before row 0 had finished
    assert all(gen is g[row] for row, _, gen in handed)
    assert g[1].finish_reason == "cancelled" and g[0].finish_reason == "length"
    plain = generate(model, ps, SamplingParams(max_new_tokens=20), row_should_stop=[
        None, lambda: False, None])
    assert g[0].tokens == plain[0].tokens and torch.equal(g[0].routes, plain[0].routes)
    assert len(g[1].routes) == len(ps[1]) + len(g[1].tokens) - 1
    assert torch.equal(g[1].routes, plain[1].routes[:len(g[1].routes)])


@pytest.mark.parametrize("fast", ["0", "1"])
def test_rows_that_end_leave_the_batch_and_the_others_decode_as_alone(model, monkeypatch, fast):
    """Once rows 0 and 1 are cancelled, later steps run on rows 2 and 3 only (moved into the
    freed cache rows), and those two still decode exactly as they do one by one (in the
    Python step and in the C++ one)."""
    monkeypatch.setenv("APPRENTICE_FAST_DECODE", fast)      # "0": steps through model.forward
    ps = prompts(6, 9, 4, 7)
    steps = {"n": 0}
    sizes = []
    forward = model.forward

    def spy(input_ids, *a, **kw):
        sizes.append(input_ids.shape[0])
        return forward(input_ids, *a, **kw)

    def count(row, token, logprob):
        steps["n"] += row == 3

    monkeypatch.setattr(model, "forward", spy)
    g = generate(model, ps, SamplingParams(max_new_tokens=16), on_token=count,
                 row_should_stop=[lambda: steps["n"] >= 3, lambda: steps["n"] >= 5, None, None])
    monkeypatch.setattr(model, "forward", forward)
    assert sizes == ([4] * 4 + [3] * 2 + [2] * 10 if fast == "0" else [4]), sizes
    assert [x.finish_reason for x in g] == ["cancelled", "cancelled", "length", "length"]
    for p, x in zip(ps[2:], g[2:]):
        single = generate(model, [p], SamplingParams(max_new_tokens=16))[0]
        assert x.tokens == single.tokens
        assert max(abs(a - b) for a, b in zip(x.logprobs, single.logprobs)) < 1e-4
        assert torch.equal(x.routes, single.routes)
    assert len(g[0].tokens) == 3 and len(g[0].routes) == len(ps[0]) + 3 - 1


@pytest.mark.parametrize("fast", ["0", "1"])
def test_a_paused_batch_resumed_gives_what_one_uninterrupted_call_gives(model, monkeypatch, fast):
    """Rows paused after 5 steps (their keys and values in the prefix cache), then resumed
    in a new batch beside a fresh prompt: tokens, logprobs, routes and prompt lengths are
    those of one call straight through, and the resumed rows feed one token each."""
    from agent_runtime.model.prefix_cache import PrefixCache
    monkeypatch.setenv("APPRENTICE_FAST_DECODE", fast)
    ps = prompts(6, 9, 4)
    sp = SamplingParams(max_new_tokens=14)
    whole = generate(model, ps, sp)
    cache = PrefixCache(64 * 2**20)
    count = {"n": 0}

    def tick(row, token, logprob):
        count["n"] += row == 0

    first = generate(model, ps[:2], sp, on_token=tick, prefix_cache=cache,
                     should_yield=lambda rows: count["n"] >= 5)
    assert [g.finish_reason for g in first] == ["paused", "paused"]
    assert [len(g.tokens) for g in first] == [5, 5]
    fresh = ps[2]
    again = generate(model, [ps[0] + first[0].tokens, ps[1] + first[1].tokens, fresh], sp,
                     prefix_cache=cache, resume=[first[0], first[1], None])
    for b in range(3):
        assert again[b].tokens == whole[b].tokens
        assert max(abs(x - y) for x, y in zip(again[b].logprobs, whole[b].logprobs)) < 1e-4
        assert torch.equal(again[b].routes, whole[b].routes)
        assert again[b].prompt_len == len(ps[b]) and again[b].finish_reason == "length"
    with pytest.raises(ValueError, match="resume"):
        generate(model, [ps[0]], sp, resume=[first[0]])     # the tokens are not in the prompt


@pytest.mark.parametrize("fast", ["0", "1"])
def test_a_ragged_prefill_runs_in_groups_and_each_row_gets_what_it_gets_alone(model, monkeypatch,
                                                                              fast):
    """Rows 0 and 3 reuse 40 cached tokens, row 0 then feeds 60 and the others 3-5: one padded
    forward would compute 4 x 60 tokens over 40 cached columns for every row. Row 0 prefills
    alone and the three short rows together instead (over their own cached columns), and
    every row decodes what it decodes in a batch of one (tokens, logprobs, routes)."""
    from agent_runtime.model.prefix_cache import PrefixCache
    monkeypatch.setenv("APPRENTICE_FAST_DECODE", fast)
    head, long, *short = prompts(40, 60, 4, 5, 3, seed=3)
    ps = [head + long, short[0], short[1], head + short[2]]
    sp = SamplingParams(max_new_tokens=10)

    def warm():                                  # a cache holding `head` (its next token aside)
        cache = PrefixCache(64 * 2**20)
        generate(model, [head], SamplingParams(max_new_tokens=1), prefix_cache=cache)
        return cache

    shapes = []
    forward = model.forward

    def spy(input_ids, *a, **kw):
        shapes.append(tuple(input_ids.shape))
        return forward(input_ids, *a, **kw)

    cache = warm()
    monkeypatch.setattr(model, "forward", spy)
    batch = generate(model, ps, sp, prefix_cache=cache)
    monkeypatch.setattr(model, "forward", forward)
    assert shapes[:2] == [(1, 60), (3, 5)], shapes
    for p, g in zip(ps, batch):
        single = generate(model, [p], sp, prefix_cache=warm())[0]
        assert g.tokens == single.tokens
        assert max(abs(a - b) for a, b in zip(g.logprobs, single.logprobs)) < 1e-4
        assert torch.equal(g.routes, single.routes)
        assert len(g.routes) == len(p) + len(g.tokens) - 1


def test_with_a_window_each_row_gets_the_budget_it_would_get_alone(model):
    """A long prompt no longer shortens the other rows' budgets: each row's is what its own
    prompt leaves of the window."""
    ps = prompts(6, 40)
    sp = SamplingParams(max_new_tokens=12)
    out = generate(model, ps, sp, window=45)
    assert [len(g.tokens) for g in out] == [12, 5]
    assert [g.finish_reason for g in out] == ["length", "length"]
    assert out[0].tokens == generate(model, [ps[0]], sp)[0].tokens
    with pytest.raises(ValueError, match="fills the context window"):
        generate(model, prompts(45), sp, window=45)


@pytest.mark.parametrize("fast", ["0", "1"])
def test_a_resumed_row_near_the_window_beside_a_fresh_one(model, monkeypatch, fast):
    """Row 0 (a prompt 10 tokens short of the window) paused after 3 tokens, resumed beside a
    fresh short prompt with its whole budget: the padded layout has more columns than the
    window, every row's own positions fit it, and both rows get what they get alone."""
    from agent_runtime.model.prefix_cache import PrefixCache
    monkeypatch.setenv("APPRENTICE_FAST_DECODE", fast)
    W = model.args.max_position
    long, short = prompts(W - 10, 5)
    sp = SamplingParams(max_new_tokens=12)
    alone = [generate(model, [x], sp, window=W)[0] for x in (long, short)]
    cache = PrefixCache(256 * 2**20)
    n = {"steps": 0}

    def after_3(rows):
        n["steps"] += 1
        return n["steps"] >= 3

    first = generate(model, [long], sp, prefix_cache=cache, should_yield=after_3, window=W)[0]
    assert first.finish_reason == "paused" and len(first.tokens) == 3
    out = generate(model, [long + first.tokens, short], sp, prefix_cache=cache,
                   resume=[first, None], window=W)
    for got, want in zip(out, alone):
        assert got.tokens == want.tokens and got.finish_reason == want.finish_reason
        assert torch.equal(got.routes, want.routes)
    assert [len(g.tokens) for g in out] == [10, 12]


def test_prefill_groups_cut_where_padding_and_forwards_cost_least():
    assert prefill_groups([5, 17, 11]) == [[0, 1, 2]]                  # padding 18 < a forward
    assert prefill_groups([60, 4, 5, 3]) == [[0], [1, 2, 3]]
    assert prefill_groups([1, 1, 1, 533, 26, 107, 34]) == [[3], [5], [4, 6], [0, 1, 2]]
    assert prefill_groups([400, 300], forward_tokens=0) == [[0], [1]]
    assert prefill_groups([400, 300], forward_tokens=1000) == [[0, 1]]
