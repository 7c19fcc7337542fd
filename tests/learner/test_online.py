"""One learning cycle on a tiny checkpoint: what it trains on, the trust region, the
baseline, staleness, and that a consumed sample is never trained on again."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent_runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from online_support import INVALID, VALID, record_session  # noqa: E402
from tiny_checkpoints import save_tiny_agent_checkpoint  # noqa: E402

from agent_runtime.policies import load_policy  # noqa: E402
from learner.gate import GateConfig, GateResult  # noqa: E402
from learner.online import (OnlineConfig, OnlineLearner, _cap_update, _scaled,  # noqa: E402
                            _sparsify_update)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_agent_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def policy(ckpt):
    return load_policy(str(ckpt), dtype="bfloat16")


def learner(store, ckpt, **over):
    config = OnlineConfig(model=str(ckpt), gate=GateConfig(n_tasks=0), **over)
    config.trainer.optim.lr = 1e-3
    return OnlineLearner(store, config)


def test_a_consumed_sample_is_never_trained_on_again(store, ckpt, policy):
    sid = record_session(store, policy, "fix it", VALID)
    store.add_feedback(1, session_id=sid)
    online = learner(store, ckpt)
    assert online.run_cycle().samples == 1
    assert online.run_cycle().samples == 0


def test_an_accepted_cycle_publishes_the_next_version(store, ckpt, policy):
    store.add_feedback(1, session_id=record_session(store, policy, "fix it", VALID))
    online = learner(store, ckpt)
    assert online.run_cycle().version == 2 and online.versions.latest().version == 2


@pytest.mark.parametrize("rating", [1, -1])
def test_a_rated_completion_alone_moves_its_way(store, ckpt, policy, rating):
    store.add_feedback(rating, session_id=record_session(store, policy, "fix it", VALID))
    online = learner(store, ckpt)
    online.config.trainer.optim.lr = 1e-4      # one small step (above bf16 rounding): first order
    shift = online.run_cycle().logprob_shift
    assert shift["liked" if rating > 0 else "disliked"] * rating > 0


def test_a_disliked_call_the_grammar_wrote_teaches_nothing(store, ckpt, policy):
    """Every token of the rated call was the grammar's choice, not the model's: a thumbs
    down on it moves nothing (learner.grpo.token_weights), so the cycle has no update."""
    store.add_feedback(-1, session_id=record_session(store, policy, "fix it", VALID,
                                                     all_forced=True))
    result = learner(store, ckpt).run_cycle()
    assert result.samples == 1 and result.version is None
    assert result.gate["reason"] == "the update does not change the published (bf16) weights"
    assert result.logprob_shift["disliked"] == 0.0


def test_with_decision_negatives_a_disliked_call_trains_up_to_its_tool_name(store, ckpt, policy):
    """negatives="decision": the learner marks each sample's decision (the tokens up to the
    first call's tool name), and a disliked call's arguments carry no loss."""
    from agent_runtime.model import load_tokenizer
    from learner.sentiment import rated_sample_ids, sample_rewards
    store.add_feedback(-1, session_id=record_session(store, policy, "fix it", VALID))
    online = learner(store, ckpt)
    online.config.trainer.loss.negatives = "decision"
    ids = rated_sample_ids(store)
    [sample] = online.train_samples(ids, sample_rewards(store, ids), 1)
    tok = load_tokenizer(ckpt)
    assert sample.advantage < 0 and 0 < sample.decision < sample.n_tokens
    assert '"read_file"' in tok.decode(sample.completion_ids[:sample.decision])
    assert '"calc.py"' not in tok.decode(sample.completion_ids[:sample.decision])
    online.config.trainer.loss.negatives = "all"
    assert online.train_samples(ids, sample_rewards(store, ids), 1)[0].decision is None


def test_with_decision_negatives_a_call_that_did_not_parse_trains_whole(store, ckpt, policy):
    """The fault of a malformed call is in its arguments: decision-scoped negatives leave
    it every token, although its tool name parses."""
    from learner.sentiment import rated_sample_ids, sample_rewards
    from agent_runtime.agent import INVALID_CALL
    sid = record_session(store, policy, "fix it", INVALID)
    [message] = [m for m in store.messages(sid) if m["role"] == "assistant"]
    store.add_tool_call(sid, message["id"], "c1", INVALID_CALL, INVALID, ok=False)
    store.add_feedback(-1, session_id=sid)
    online = learner(store, ckpt)
    online.config.trainer.loss.negatives = "decision"
    ids = rated_sample_ids(store)
    [sample] = online.train_samples(ids, sample_rewards(store, ids), 1)
    assert sample.advantage < 0 and sample.decision is None


def test_a_call_cut_off_in_a_loop_is_marked_with_the_loop(store, ckpt, policy):
    """The learner marks the repeats a cut-off call ran into (`TrainSample.loop`, for
    `LossConfig.unlikelihood`); a call that ended by itself is not marked."""
    from learner.sentiment import rated_sample_ids, sample_rewards
    looping = INVALID[:-len("\n</tool_call>")] + ' "old": "x' + ' works\\"' * 40
    cut = record_session(store, policy, "fix it", looping, stop=False)
    ended = record_session(store, policy, "fix it", VALID)
    for sid in (cut, ended):
        store.add_feedback(-1, session_id=sid)
    online = learner(store, ckpt)
    ids = rated_sample_ids(store)
    by_session = {s.session_id: s for s in online.train_samples(ids, sample_rewards(store, ids), 1)}
    tok = policy.tokenizer
    marked = by_session[cut]
    assert len(marked.loop) >= 24 and marked.loop[-1] == marked.n_tokens - 1
    assert "works" in tok.decode([marked.completion_ids[i] for i in marked.loop])
    assert '"edit_file"' not in tok.decode([marked.completion_ids[i] for i in marked.loop])
    assert by_session[ended].loop == ()


def test_samples_of_versions_beyond_the_staleness_limit_are_dropped(store, ckpt, policy):
    store.add_feedback(1, session_id=record_session(store, policy, "new", VALID, version=1))
    online = learner(store, ckpt, max_staleness=0)
    online.serving_state()                                  # v1: the base
    state = dict(online.versions.state(1))
    state["lm_head.weight"] = state["lm_head.weight"] * 2
    online.versions.publish(state)                          # v2 serves
    result = online.run_cycle()
    assert (result.samples, result.gate["reason"]) == (0, "no sample carries a reward")


def test_the_baseline_is_the_mean_reward_of_consumed_samples(store, ckpt, policy):
    store.add_feedback(1, session_id=record_session(store, policy, "a", VALID))
    store.add_feedback(1, session_id=record_session(store, policy, "b", VALID))
    store.add_feedback(-1, session_id=record_session(store, policy, "c", INVALID))
    online = learner(store, ckpt)
    online.run_cycle()
    assert online.baseline() == pytest.approx(1 / 3)


def test_the_trust_region_scales_a_large_update_back_to_its_cap():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    serving = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    assert _cap_update(model, serving, 1e-2) == 1e-2
    moved = sum(float((p.detach() - serving[n]).pow(2).sum())
                for n, p in model.named_parameters())
    size = sum(float(v.pow(2).sum()) for v in serving.values())
    assert (moved / size) ** 0.5 == pytest.approx(1e-2, rel=1e-4)


def test_a_small_update_is_left_as_it_is():
    model = torch.nn.Linear(4, 4)
    serving = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight[0, 0] += 1e-6
    before = model.weight.detach().clone()
    _cap_update(model, serving, 1e-2)
    assert torch.equal(model.weight, before)


def test_a_sparse_update_keeps_the_published_changes_that_do_the_most_for_the_objective():
    torch.manual_seed(0)
    model = torch.nn.Linear(100, 100)
    serving = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    grad = {"weight": torch.randn(100, 100), "bias": torch.randn(100)}
    with torch.no_grad():
        model.load_state_dict({k: v.float() for k, v in serving.items()})
        model.weight.sub_(grad["weight"].sign() * 3e-3)        # a descent step on every weight
        model.bias.sub_(grad["bias"].sign() * 3e-3)
        old = serving["weight"].float()
        model.weight[3, 7] = old[3, 7] + 0.5                   # large, but against the objective
        grad["weight"][3, 7] = 10.0
        model.weight[5, 5] = old[5, 5] + 1e-7                  # rounds away in bf16
        grad["weight"][5, 5] = -1e3
        model.weight[9, 1] = old[9, 1] - 0.25                  # large and with it
        grad["weight"][9, 1] = 1.0
    published = model.weight.detach().to(torch.bfloat16).float() - old
    score = (-published * grad["weight"]).clamp_min(0)
    kept = _sparsify_update(model, serving, 0.05,
                            lambda p: grad["weight"] if p is model.weight else grad["bias"])
    changed = model.weight != old
    assert kept == pytest.approx(0.05, abs=0.01)
    assert changed[9, 1] and not changed[3, 7] and not changed[5, 5]
    assert float(score[changed].min()) >= float(score[~changed].max())
    assert torch.equal(model.weight[~changed], old[~changed])
    assert _sparsify_update(model, serving, 1.0, lambda p: None) == 1.0


def test_a_cycle_changes_at_most_its_share_of_the_published_weights(store, ckpt, policy):
    store.add_feedback(1, session_id=record_session(store, policy, "fix it", VALID))
    online = learner(store, ckpt, max_changed=0.02, max_update=0.0)
    result = online.run_cycle()
    old, new = online.versions.state(1), online.versions.state(result.version)
    changed = sum(int((old[k] != new[k]).sum()) for k in old)
    assert 0 < changed <= 0.02 * sum(t.numel() for t in old.values())


def test_an_update_too_small_to_change_the_bf16_weights_publishes_nothing(store, ckpt, policy):
    store.add_feedback(1, session_id=record_session(store, policy, "fix it", VALID))
    online = learner(store, ckpt)
    online.config.trainer.optim.lr = 1e-12
    result = online.run_cycle()
    assert result.version is None and "does not change" in result.gate["reason"]


class StepSizeGate:
    """Passes a candidate only when no weight moved more than `limit` from serving (the
    held-out evaluation's verdict, reduced to the one thing this test varies)."""

    def __init__(self, limit: float):
        self.limit, self.seen = limit, []

    def check(self, serving, serving_sha, candidate, candidate_sha=None, anchor=None):
        moved = max(float((candidate[k].float() - serving[k].float()).abs().max()) for k in serving)
        self.seen.append(moved)
        if moved > self.limit:
            return GateResult(False, f"moved {moved:.2e}")
        return GateResult(True, "small enough")


@pytest.mark.parametrize("backtrack", [0, 1])
def test_a_rejected_candidate_is_halved_and_gated_again(store, ckpt, policy, backtrack, tmp_path):
    from agent_runtime.store import SessionStore
    sizing = SessionStore(tmp_path / "sizing")          # the same cycle, gated by nothing,
    for s in (sizing, store):                           # to size the gate by its full step
        s.add_feedback(1, session_id=record_session(s, policy, "fix it", VALID))
    probe = learner(sizing, ckpt, max_update=0.0, backtrack=0)
    probe._gate = StepSizeGate(float("inf"))
    assert probe.run_cycle().version == 2
    first = probe._gate.seen[0]
    online = learner(store, ckpt, max_update=0.0, backtrack=backtrack)
    online._gate = StepSizeGate(0.75 * first)
    result = online.run_cycle()
    assert online._gate.seen[0] == first                # the same step: rejected
    if backtrack == 0:
        assert result.version is None and result.gate["scale"] == 1.0
        return
    assert result.version == 2 and result.gate["scale"] == 0.5
    assert result.gate["rejected_first"] == [f"moved {first:.2e}"]
    assert 0 < online._gate.seen[1] <= 0.75 * first
    full, half = probe.versions.state(2), online.versions.state(2)
    serving = online.versions.state(1)
    assert all(torch.equal(half[k], v) for k, v in _scaled(serving, full, 0.5).items())


def test_scaling_a_change_keeps_unchanged_weights_and_halves_the_rest():
    serving = {"w": torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)}
    candidate = {"w": torch.tensor([1.0, 2.5, 2.0], dtype=torch.bfloat16)}
    half = _scaled(serving, candidate, 0.5)["w"]
    assert half.dtype == torch.bfloat16 and half.tolist() == [1.0, 2.25, 2.5]
    assert torch.equal(_scaled(serving, candidate, 1.0)["w"], candidate["w"])
    one = torch.nextafter(serving["w"], torch.full_like(serving["w"], 9.0))   # one spacing up
    assert torch.equal(_scaled(serving, {"w": one}, 0.5)["w"], serving["w"])  # half: none
    assert torch.equal(_scaled(serving, {"w": one}, 0.9)["w"], serving["w"])
