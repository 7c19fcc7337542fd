"""EnginePolicy: the agent's Policy over the real MoE engine, tokenizer and chat template."""

import pytest
import torch

from agent_runtime.agent import Agent, AgentConfig
from agent_runtime.policies import load_policy
from agent_runtime.store import SessionStore
from tiny_checkpoints import save_tiny_agent_checkpoint

MESSAGES = [{"role": "system", "content": "You are a test."},
            {"role": "user", "content": "Fix calc.py so that add() adds."}]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    path = save_tiny_agent_checkpoint(tmp_path_factory.mktemp("ckpt"))
    return load_policy(str(path), temperature=1.0, seed=0, max_new_tokens=24)


def test_completion_ids_logprobs_and_routes_line_up(policy):
    c = policy.complete(MESSAGES)
    assert c.prompt_ids == policy.tokenizer.encode(policy.template.render(MESSAGES, add_generation_prompt=True))
    assert len(c.logprobs) == len(c.completion_ids) > 0
    a = policy.model.args
    assert c.routes.shape == (len(c.prompt_ids) + len(c.completion_ids) - 1, a.num_moe_layers, a.top_k)
    kept = [t for t in c.completion_ids if t not in policy.stop_token_ids]
    assert policy.tokenizer.decode(kept) == c.text


def test_streamed_text_equals_final_text(policy):
    chunks = []
    c = policy.complete(MESSAGES, on_text=chunks.append)
    assert "".join(chunks) == c.text


def test_recorded_routes_replay_the_behaviour_logprobs(policy):
    c = policy.complete(MESSAGES)
    ids = torch.tensor([c.prompt_ids + c.completion_ids[:-1]])
    with torch.no_grad():
        out = policy.model(ids, routes=torch.from_numpy(c.routes).long()[None])
    lp = out.logits[0, len(c.prompt_ids) - 1:].log_softmax(-1)
    lp = lp.gather(-1, torch.tensor(c.completion_ids)[:, None])[:, 0]
    assert (lp - torch.tensor(c.logprobs)).abs().max().item() < 1e-5


def test_swap_state_changes_weights_and_version(policy):
    before = policy.model.lm_head.weight.clone()
    policy.swap_state(lambda state: state["lm_head.weight"].mul_(1.5), version=7)
    assert policy.version == 7
    assert torch.allclose(policy.model.lm_head.weight, before * 1.5)
    policy.swap_state(lambda state: state["lm_head.weight"].copy_(before), version=0)


def test_agent_loop_on_the_engine_records_samples_that_decode_to_the_text(policy, tmp_path):
    (tmp_path / "ws").mkdir()
    store = SessionStore(tmp_path / "home")
    result = Agent(policy, store=store, workspace=tmp_path / "ws",
                   config=AgentConfig(max_steps=2)).run("Say hello.")
    assert result.status == "budget_exhausted"          # random weights never call finish
    samples = store.samples(result.session_id)
    assistant = [m for m in store.messages(result.session_id) if m["role"] == "assistant"]
    assert len(samples) == len(assistant) == 2
    for s, m in zip(samples, assistant):
        assert s["message_id"] == m["id"]
        assert len(s["logprobs"]) == len(s["completion_ids"])
        assert s["routes"].shape[0] == len(s["prompt_ids"]) + len(s["completion_ids"]) - 1
        text = policy.tokenizer.decode([t for t in s["completion_ids"] if t not in policy.stop_token_ids])
        assert m["content"].strip() in text


def test_a_call_that_loops_is_sampled_again_hotter(tmp_path):
    path = save_tiny_agent_checkpoint(tmp_path / "ckpt")
    looping = load_policy(str(path), max_new_tokens=120, loop_span=16, seed=0)   # greedy
    with torch.no_grad():
        looping.model.norm.weight.zero_()        # every logit 0: greedy repeats token 0
    looping.stop_token_ids = []                  # (which is a stop token here)
    chunks = []
    c = looping.complete(MESSAGES, on_text=chunks.append)
    assert c.temperature == 0.7 and c.finish_reason != "loop"   # the first fallback did not loop
    assert len(set(c.completion_ids)) > 1
    assert "[repeating itself: sampling again at temperature 0.7]" in "".join(chunks)
    assert abs(sum(c.logprobs) / len(c.logprobs) + torch.log(torch.tensor(
        float(looping.model.args.vocab_size))).item()) < 1e-4   # uniform at T = 0.7 too
    plain = load_policy(str(path), max_new_tokens=120, loop_span=16, loop_fallback=())
    with torch.no_grad():
        plain.model.norm.weight.zero_()
    plain.stop_token_ids = []
    c = plain.complete(MESSAGES)
    assert c.finish_reason == "loop" and c.temperature == 0.0 and len(c.completion_ids) == 16


def test_a_greedy_calls_retry_is_drawn_the_same_way_every_time(tmp_path):
    """A greedy call that loops is sampled again from a stream seeded by its prompt: the same
    call gets the same retry in two calls and beside another conversation (an evaluation of
    greedy decoding repeats itself); another prompt gets another retry."""
    path = save_tiny_agent_checkpoint(tmp_path / "ckpt")
    policy = load_policy(str(path), max_new_tokens=40, loop_span=16)   # greedy, no seed
    with torch.no_grad():
        policy.model.norm.weight.zero_()         # every logit 0: greedy repeats token 0
    policy.stop_token_ids = []
    other = MESSAGES[:-1] + [{"role": "user", "content": "Something else entirely."}]
    first, again = policy.complete(MESSAGES), policy.complete(MESSAGES)
    beside = policy.complete_many([other, MESSAGES])
    assert first.temperature == again.temperature == beside[1].temperature == 0.7
    assert first.completion_ids == again.completion_ids == beside[1].completion_ids
    assert beside[0].completion_ids != first.completion_ids


def test_a_checkpoint_trained_with_mentions_says_so_and_others_do_not(tmp_path):
    import json
    path = save_tiny_agent_checkpoint(tmp_path / "ckpt")
    assert load_policy(str(path)).mentions is False
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "apprentice_mentions": True}))
    assert load_policy(str(path)).mentions is True


def test_complete_many_hands_over_each_row_once_and_a_looping_one_after_its_retries(tmp_path):
    path = save_tiny_agent_checkpoint(tmp_path / "ckpt")
    policy = load_policy(str(path), max_new_tokens=40, loop_span=16, seed=0)
    with torch.no_grad():
        policy.model.norm.weight.zero_()         # every logit 0: greedy repeats token 0
    policy.stop_token_ids = []
    handed = []
    out = policy.complete_many([MESSAGES, MESSAGES], should_stop=[None, lambda: True],
                               on_complete=lambda i, c: handed.append((i, c)))
    assert [i for i, _ in handed] == [1, 0]       # the cancelled row at once, the looping
    assert handed[0][1] is out[1] and handed[1][1] is out[0]      # one after its retry
    assert out[0].temperature == 0.7 and out[1].finish_reason == "cancelled"



def test_a_later_call_feeds_the_ids_the_model_wrote_not_a_re_rendering(policy):
    c = policy.complete(MESSAGES)                 # random weights: ids no merge would make
    assert c.finish_reason == "length"
    said = {"role": "assistant", "content": "Reading calc.py."}   # what the loop made of it
    policy.remember(said, c)
    later = MESSAGES + [said, {"role": "user", "content": "Go on."}]
    text = policy.template.render(later)
    ids = policy.render(later)
    assert ids[:len(c.prompt_ids) + len(c.completion_ids)] == c.prompt_ids + c.completion_ids
    rest = text[text.rindex("<|im_end|>", 0, text.index("Go on.")):]   # the turn was cut off:
    assert ids[len(c.prompt_ids) + len(c.completion_ids):] == policy.tokenizer.encode(rest)
    assert policy.count_tokens(later) == len(ids)
    canonical = policy.tokenizer.encode(text)
    assert ids != canonical
    # an equal message the agent did not make of it, other messages before it, or the
    # switch off: the conversation rendered
    assert policy.render(MESSAGES + [dict(said), later[-1]]) == canonical
    edited = [{**MESSAGES[0], "content": "You are another test."}] + later[1:]
    assert policy.render(edited) == policy.tokenizer.encode(policy.template.render(edited))
    plain = load_policy(policy.name, exact_history=False, max_new_tokens=24)
    plain.remember(said, plain.complete(MESSAGES))
    assert plain.render(later) == canonical


def test_a_turn_the_model_ended_goes_on_after_its_own_end_token(tmp_path):
    path = save_tiny_agent_checkpoint(tmp_path / "ckpt")
    policy = load_policy(str(path), max_new_tokens=8)
    with torch.no_grad():
        policy.model.norm.weight.zero_()         # every logit 0: greedy writes token 0, an end
    c = policy.complete(MESSAGES)
    assert c.completion_ids == [0] and 0 in policy.stop_token_ids
    said = {"role": "assistant", "content": ""}
    policy.remember(said, c)
    later = MESSAGES + [said, {"role": "user", "content": "Go on."}]
    text = policy.template.render(later)
    assert text[len(policy.template.render(MESSAGES)):].startswith("<|im_end|>\n")   # not token 0
    rest = text[text.rindex("<|im_end|>", 0, text.index("Go on.")) + len("<|im_end|>"):]
    assert policy.render(later) == c.prompt_ids + [0] + policy.tokenizer.encode(rest)


def test_an_agent_episodes_calls_each_extend_the_last_one(policy, tmp_path):
    (tmp_path / "ws").mkdir()
    store = SessionStore(tmp_path / "home")
    result = Agent(policy, store=store, workspace=tmp_path / "ws",
                   config=AgentConfig(max_steps=3)).run("Say hello.")
    samples = store.samples(result.session_id)
    assert len(samples) == 3
    for a, b in zip(samples, samples[1:]):        # random ids, re-rendered, would not
        fed = list(a["prompt_ids"]) + list(a["completion_ids"])
        assert list(b["prompt_ids"][:len(fed)]) == fed
