"""GRPO math against hand-computed cases: advantages, the clipped/truncated loss, its gradient."""

import math

import numpy as np
import pytest
import torch

from learner.config import LossConfig
from learner.grpo import (Episode, Group, behaviour_kl, group_advantages, group_samples,
                          policy_loss)


def test_advantages_are_mean_centred_without_std_by_default():
    assert group_advantages([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages([3.0, 0.0, 0.0]) == [2.0, -1.0, -1.0]


def test_std_normalization_is_optional():
    adv = group_advantages([3.0, 0.0, 0.0], normalize_std=True, eps=0.0)
    std = math.sqrt(2.0)                                   # population std of (3, 0, 0)
    assert adv == pytest.approx([2.0 / std, -1.0 / std, -1.0 / std])


def test_zero_variance_groups_are_dropped():
    assert group_advantages([1.0, 1.0, 1.0]) is None
    assert group_advantages([0.0] * 8) is None
    group = Group("t", [Episode("a", 1.0), Episode("b", 1.0)], [[_sample(3)], [_sample(3)]])
    assert group_samples(group) == []


def _sample(n: int, version: int = 1, segment: int = 0) -> dict:
    return {"prompt_ids": [1, 2], "completion_ids": list(range(5, 5 + n)),
            "logprobs": [-1.0] * n, "routes": np.zeros((2 + n - 1, 1, 2), np.uint8),
            "policy_version": version, "segment": segment}


def test_every_segment_of_an_episode_gets_its_final_advantage():
    # episode a was split by self-summarization: three calls over two segments (the summary
    # call included); all of them carry a's advantage, so the summary is trained too
    a = [_sample(2, segment=0), _sample(4, segment=0), _sample(3, segment=1)]
    b = [_sample(2)]
    out = group_samples(Group("t", [Episode("a", 1.0), Episode("b", 0.0)], [a, b]))
    assert [s.advantage for s in out] == [0.5, 0.5, 0.5, -0.5]
    assert [s.session_id for s in out] == ["a", "a", "a", "b"]
    assert [s.n_tokens for s in out] == [2, 4, 3, 2]


def test_calls_without_completion_tokens_are_skipped():
    out = group_samples(Group("t", [Episode("a", 1.0), Episode("b", 0.0)],
                              [[_sample(0), _sample(2)], [_sample(1)]]))
    assert [s.n_tokens for s in out] == [2, 1]


CASES = [
    # (ratio, advantage, loss, d loss / d logprob)          eps 0.2 / 0.28, cap 3
    (1.0, 1.0, -1.0, -1.0),          # on-policy: plain policy gradient
    (1.1, 1.0, -1.1, -1.1),          # inside the clip range
    (1.5, 1.0, -1.28, 0.0),          # above 1 + eps_high with A > 0: clipped, no gradient
    (0.5, 1.0, -0.5, -0.5),          # below 1 - eps_low with A > 0: not clipped (pessimistic)
    (0.5, -1.0, 0.8, 0.0),           # below 1 - eps_low with A < 0: clipped, no gradient
    (1.25, -1.0, 1.25, 1.25),        # inside the range with A < 0: r * |A|
    (2.0, -1.0, 2.0, 2.0),           # above 1 + eps_high with A < 0: unclipped, r * |A|
    (5.0, -1.0, 3.0, 0.0),           # above the cap: truncated at 3 * |A|, no gradient
    (1.0, -0.5, 0.5, 0.5),
]


@pytest.mark.parametrize("ratio,adv,loss,grad", CASES)
def test_loss_and_gradient_match_hand_computation(ratio, adv, loss, grad):
    behaviour = torch.tensor([-2.0], dtype=torch.float64)
    lp = (behaviour + math.log(ratio)).requires_grad_(True)
    out, _ = policy_loss(lp, behaviour, torch.tensor([adv], dtype=torch.float64),
                         LossConfig(eps_low=0.2, eps_high=0.28, ratio_cap=3.0))
    out.sum().backward()
    assert float(out.detach()) == pytest.approx(loss, abs=1e-12)
    assert float(lp.grad) == pytest.approx(grad, abs=1e-12)


@pytest.mark.parametrize("weight,gamma", [(1.0, 0.0), (0.25, 0.0), (1.0, 0.1), (0.5, 0.05)])
def test_an_off_policy_tokens_term_is_weighted_and_shaped_and_never_clipped(weight, gamma):
    """A guide's token (behaviour = the trainer's own logprob, ratio 1): its gradient in
    log p is -w * A, or with LUFFY's shaping -w * A * gamma p / (p + gamma)^2, at every p,
    where an on-policy token far above the clip range would get none; on-policy tokens in
    the same call keep their clipped term."""
    p = torch.tensor([0.9, 0.1, 0.001, 0.5], dtype=torch.float64)
    lp = p.log().requires_grad_(True)
    behaviour = torch.cat([lp.detach()[:3], torch.tensor([math.log(0.1)], dtype=torch.float64)])
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    off = torch.tensor([True, True, True, False])
    out, _ = policy_loss(lp, behaviour, adv, LossConfig(guide_weight=weight, guide_shaping=gamma),
                         off_policy=off)
    out.sum().backward()
    for i in range(3):
        shaped = gamma * p[i] / (p[i] + gamma) ** 2 if gamma else 1.0
        assert float(lp.grad[i]) == pytest.approx(-weight * float(shaped), rel=1e-9)
    assert float(lp.grad[3]) == 0.0               # on-policy at ratio 5 > 1 + eps_high: clipped
    plain, _ = policy_loss(lp.detach(), behaviour, adv, LossConfig())
    assert float(out.detach()[3]) == float(plain[3])


def test_statistics_count_clipped_and_truncated_tokens():
    behaviour = torch.zeros(5)
    lp = torch.log(torch.tensor([1.0, 1.5, 0.5, 5.0, 2.0]))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0])
    _, stats = policy_loss(lp, behaviour, adv, LossConfig())
    assert stats["tokens"] == 5
    assert stats["clip_high"] == 1 and stats["clip_low"] == 1 and stats["truncated"] == 1
    assert stats["ratio_sum"] == pytest.approx(10.0)


def test_cap_below_the_clip_range_is_refused():
    with pytest.raises(ValueError, match="ratio_cap"):
        policy_loss(torch.zeros(1), torch.zeros(1), torch.ones(1), LossConfig(ratio_cap=1.1))


def test_kl_penalty_is_k3_to_the_reference_and_off_by_default():
    lp = torch.tensor([math.log(0.5)], requires_grad=True)
    ref = torch.tensor([math.log(0.25)])
    base, _ = policy_loss(lp, lp.detach(), torch.zeros(1), LossConfig())
    assert float(base.detach()) == 0.0
    with pytest.raises(ValueError):
        policy_loss(lp, lp.detach(), torch.zeros(1), LossConfig(kl_coef=0.1))
    out, stats = policy_loss(lp, lp.detach(), torch.zeros(1), LossConfig(kl_coef=0.1), ref)
    k3 = 0.5 - math.log(0.5) - 1.0                        # exp(d) - d - 1, d = log(0.25/0.5)
    assert float(out.detach()) == pytest.approx(0.1 * k3)
    assert stats["ref_kl_sum"] == pytest.approx(k3)


def test_kl_penalty_is_clamped_far_from_the_reference():
    """A token 12 nats below the reference: unclamped k3 is e^12 ~ 160,000 with a gradient
    as large; clamped (veRL's low_var_kl) it is 10 and pulls nothing, while a token 1 nat
    below keeps its exact k3 and gradient."""
    lp = torch.tensor([-13.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.0, -1.0])
    out, stats = policy_loss(lp, lp.detach(), torch.zeros(2), LossConfig(kl_coef=1.0), ref)
    out.sum().backward()
    assert float(out[0].detach()) == pytest.approx(10.0)
    assert float(out[1].detach()) == pytest.approx(math.e - 2.0)
    assert float(lp.grad[0]) == 0.0 and float(lp.grad[1]) == pytest.approx(1.0 - math.e)
    assert stats["ref_kl_sum"] == pytest.approx(10.0 + math.e - 2.0)


def test_batch_loss_is_a_token_level_mean():
    # two samples of 1 and 3 tokens, advantages +1 and -1, on-policy: the batch loss is the
    # mean over the 4 tokens, (-1 + 1 + 1 + 1) / 4, not the mean of per-sample means (0)
    lp = torch.zeros(4, requires_grad=True)
    adv = torch.tensor([1.0, -1.0, -1.0, -1.0])
    out, _ = policy_loss(lp, torch.zeros(4), adv)
    assert float(out.detach().sum() / 4) == pytest.approx(0.5)


def test_behaviour_kl_is_zero_on_policy_and_positive_off_policy():
    b = torch.log(torch.tensor([0.2, 0.5]))
    assert behaviour_kl(b, b).abs().max() == 0
    kl = behaviour_kl(b + torch.tensor([0.1, -0.3]), b)
    expected = [math.exp(0.1) - 1 - 0.1, math.exp(-0.3) - 1 + 0.3]
    assert kl.tolist() == pytest.approx(expected, rel=1e-5)
