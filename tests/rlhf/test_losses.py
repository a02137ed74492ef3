"""rlhf.losses against independent references: Python loops and `math` formulas on hand-made tensors."""

import math
import random
import statistics

import pytest
import torch

from rlhf.losses import (GRPO_LOSS_TYPES, AdaptiveKLController, FixedKLController, approx_kl, diverging_reward_loss,
                         dpo_loss, entropy_from_logits, equal_reward_groups, gae, grpo_advantages, grpo_loss,
                         grpo_token_weights, kl_controller, kl_estimate, last_token_scores, masked_mean, masked_sum,
                         masked_whiten, pairwise_reward_loss, ppo_policy_loss, reinforce_pp_returns, rloo_advantages,
                         shape_rewards, soft_overlong_penalty, token_logprobs, truncated_is_weights,
                         value_loss)

F64 = torch.float64


def t(rows):
    return torch.tensor(rows, dtype=F64)


def prefix_mask(lengths, width):
    return torch.tensor([[1] * n + [0] * (width - n) for n in lengths])


def softplus(x):
    """log(1 + e^x), without overflow."""
    return math.log1p(math.exp(-abs(x))) + max(x, 0.0)


def neg_logsigmoid(x):
    return softplus(-x)


def assert_close(actual, expected, tol=1e-10):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=tol, atol=tol)


def test_masked_sum_and_mean_ignore_masked_entries_and_empty_rows():
    x = t([[1.0, 2.0, float("nan")], [float("inf"), 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [0, 0, 0]])
    assert_close(masked_sum(x, mask), 1 + 2 + 5 + 6)
    assert_close(masked_mean(x, mask), (1 + 2 + 5 + 6) / 4)
    assert_close(masked_sum(x, mask, dim=1), [3.0, 11.0, 0.0])
    assert_close(masked_mean(x, mask.bool(), dim=1), [1.5, 5.5, 0.0])
    assert_close(masked_mean(x, torch.zeros_like(mask)), 0.0)


def test_masked_whiten_matches_unbiased_statistics_of_the_masked_entries():
    x = t([[1.0, 4.0, 100.0], [2.0, 8.0, -50.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    real = [1.0, 4.0, 2.0, 8.0]
    mean, variance = statistics.fmean(real), statistics.variance(real)  # variance: n - 1
    scale = 1 / math.sqrt(variance + 1e-8)
    expected = [[(1 - mean) * scale, (4 - mean) * scale, 0.0], [(2 - mean) * scale, (8 - mean) * scale, 0.0]]
    assert_close(masked_whiten(x, mask), expected)
    shifted = [[v + mean if m else 0.0 for v, m in zip(row, mrow)] for row, mrow in zip(expected, mask.tolist())]
    assert_close(masked_whiten(x, mask, shift_mean=False), shifted)
    # One entry or none: zeros, not NaN.
    assert_close(masked_whiten(x, torch.tensor([[0, 1, 0], [0, 0, 0]])), torch.zeros(2, 3))
    assert_close(masked_whiten(x, torch.zeros(2, 3)), torch.zeros(2, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_and_entropy_match_explicit_formulas(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 5, 11, generator=g)).to(dtype).requires_grad_()
    tokens = torch.randint(0, 11, (3, 5), generator=g)
    logp = token_logprobs(logits, tokens)
    entropy = entropy_from_logits(logits)
    assert logp.dtype == entropy.dtype == torch.float32 and logp.shape == entropy.shape == (3, 5)
    reference = torch.log_softmax(logits.detach().double(), dim=-1)
    torch.testing.assert_close(logp.double(), reference.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
    for b in range(3):
        for i in range(5):
            row = logits[b, i].detach().double().tolist()
            z = sum(math.exp(v) for v in row)
            expected = -sum(math.exp(v) / z * (v - math.log(z)) for v in row)
            assert entropy[b, i].item() == pytest.approx(expected, rel=1e-5, abs=1e-5)
    logp.sum().backward()  # differentiable
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


def test_kl_estimators_match_schulman_formulas():
    logp, ref = t([[-1.0, -0.2, -3.0]]), t([[-1.5, -0.2, -0.5]])
    pairs = list(zip(logp[0].tolist(), ref[0].tolist()))
    assert_close(kl_estimate(logp, ref, "k1"), [[a - b for a, b in pairs]])
    assert_close(kl_estimate(logp, ref, "k2"), [[0.5 * (a - b) ** 2 for a, b in pairs]])
    assert_close(kl_estimate(logp, ref, "k3"), [[math.exp(b - a) - (b - a) - 1 for a, b in pairs]])
    with pytest.raises(ValueError, match="'k4'"):
        kl_estimate(logp, ref, "k4")


def test_approx_kl_is_k3_of_old_to_new():
    logp, old = t([[-1.0, -2.0]]).requires_grad_(), t([[-1.3, -1.0]])
    expected = [[math.exp(n - o) - 1 - (n - o) for n, o in zip([-1.0, -2.0], [-1.3, -1.0])]]
    kl = approx_kl(logp, old)
    assert_close(kl, expected)
    assert not kl.requires_grad


@pytest.mark.parametrize("reward_clip", [1.0, None, 0.0])
def test_shape_rewards_penalizes_kl_and_adds_the_clipped_score_at_the_last_real_token(reward_clip):
    logp = t([[-1.0, -2.0, -0.5, -1.0], [-0.1, -0.2, 9.0, 9.0], [5.0, 5.0, 5.0, 5.0]])
    ref = t([[-1.5, -1.0, -0.5, -2.0], [-0.3, -0.1, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    lengths, scores, kl_coef = [4, 2, 0], [2.0, -0.5, 3.0], 0.1
    rewards, kl = shape_rewards(t(scores), logp, ref, prefix_mask(lengths, 4), kl_coef, reward_clip)
    expected_rewards, expected_kl = [], []
    for b, n in enumerate(lengths):
        score = scores[b] if not reward_clip else min(max(scores[b], -reward_clip), reward_clip)
        kl_row = [logp[b, i].item() - ref[b, i].item() if i < n else 0.0 for i in range(4)]
        reward_row = [-kl_coef * k for k in kl_row]
        if n:
            reward_row[n - 1] += score
        expected_kl.append(kl_row)
        expected_rewards.append(reward_row)
    assert_close(kl, expected_kl)
    assert_close(rewards, expected_rewards)


def reference_gae(rewards, values, gamma, lam):
    """Backward recursion over one episode's lists; the value after the last step is 0."""
    advantages, running = [0.0] * len(rewards), 0.0
    for i in reversed(range(len(rewards))):
        next_value = values[i + 1] if i + 1 < len(rewards) else 0.0
        running = rewards[i] + gamma * next_value - values[i] + gamma * lam * running
        advantages[i] = running
    return advantages, [a + v for a, v in zip(advantages, values)]


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.95), (0.9, 0.0), (1.0, 1.0)])
def test_gae_matches_a_python_backward_loop(gamma, lam):
    rng = random.Random(int(gamma * 100 + lam * 10))
    lengths, width = [6, 3, 0, 1, 5], 6
    rewards = [[rng.gauss(0, 1) for _ in range(width)] for _ in lengths]
    values = [[rng.gauss(0, 1) for _ in range(width)] for _ in lengths]
    padded_rewards = [[r if i < n else 1e6 for i, r in enumerate(row)] for row, n in zip(rewards, lengths)]
    padded_values = [[v if i < n else -1e6 for i, v in enumerate(row)] for row, n in zip(values, lengths)]
    advantages, returns = gae(t(padded_rewards), t(padded_values), prefix_mask(lengths, width), gamma, lam)
    for b, n in enumerate(lengths):
        expected_adv, expected_ret = reference_gae(rewards[b][:n], values[b][:n], gamma, lam)
        assert_close(advantages[b], expected_adv + [0.0] * (width - n))
        assert_close(returns[b], expected_ret + [0.0] * (width - n))


def test_ppo_policy_loss_and_clip_flags_match_the_scalar_formula():
    clip = 0.2
    new = [math.log(1.1), math.log(1.5), math.log(1.5), math.log(0.5), math.log(0.5), 0.0]
    old = [0.0] * 6
    adv = [1.0, 2.0, -2.0, -1.0, 3.0, 0.7]
    loss, clipped = ppo_policy_loss(t([new]), t([old]), t([adv]), clip)
    expected_loss, expected_clipped = [], []
    for n, o, a in zip(new, old, adv):
        ratio = math.exp(n - o)
        clipped_term = min(max(ratio, 1 - clip), 1 + clip) * a
        expected_loss.append(-min(ratio * a, clipped_term))
        expected_clipped.append(clipped_term < ratio * a)
    assert_close(loss, [expected_loss])
    assert clipped.tolist() == [expected_clipped] == [[False, True, False, True, False, False]]


def test_truncated_importance_weights_match_the_scalar_formula():
    cap = 2.0
    old = [math.log(0.5), math.log(0.3), math.log(0.9), math.log(0.05)]
    sampler = [math.log(0.5), math.log(0.6), math.log(0.3), math.log(0.01)]
    weights, truncated = truncated_is_weights(t([old]).requires_grad_(), t([sampler]), cap)
    ratios = [math.exp(o - s) for o, s in zip(old, sampler)]  # 1, 0.5, 3, 5
    assert_close(weights, [[min(r, cap) for r in ratios]])
    assert truncated.tolist() == [[r > cap for r in ratios]] == [[False, False, True, True]]
    assert not weights.requires_grad  # a weight on the loss, not a path for its gradient


@pytest.mark.parametrize("clip", [0.2, None, 0.0])
def test_value_loss_matches_the_scalar_formula(clip):
    values, old, returns = [1.0, 0.5, -1.0, 2.0], [0.5, 0.5, 0.0, 2.1], [2.0, 0.0, -3.0, 1.0]
    expected = []
    for v, o, r in zip(values, old, returns):
        if clip:
            clipped_v = o + min(max(v - o, -clip), clip)
            expected.append(0.5 * max((v - r) ** 2, (clipped_v - r) ** 2))
        else:
            expected.append(0.5 * (v - r) ** 2)
    assert_close(value_loss(t([values]), t([old]), t([returns]), clip), [expected])


def test_adaptive_kl_controller_follows_ziegler_step_by_step():
    controller = kl_controller(0.2, target=6.0, horizon=10000)
    assert isinstance(controller, AdaptiveKLController)
    coef = 0.2
    for current_kl, n_steps in [(10.0, 256), (3.0, 256), (6.6, 512), (0.0, 64), (6.0, 256)]:
        error = min(max(current_kl / 6.0 - 1, -0.2), 0.2)
        coef *= 1 + error * n_steps / 10000
        controller.update(current_kl, n_steps)
        assert controller.coef == pytest.approx(coef, rel=1e-12)
    restored = kl_controller(0.2, target=6.0)
    restored.load_state_dict(controller.state_dict())
    assert restored.coef == controller.coef

    fixed = kl_controller(0.05)
    assert isinstance(fixed, FixedKLController) and not isinstance(fixed, AdaptiveKLController)
    fixed.update(100.0, 256)
    assert fixed.coef == 0.05 and fixed.state_dict() == {"coef": 0.05}


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_dpo_loss_matches_the_scalar_formula(label_smoothing):
    beta = 0.1
    pc, pr, rc, rr = [-10.0, -4.0, -30.0], [-12.0, -3.0, -30.0], [-11.0, -4.5, -25.0], [-11.0, -2.0, -20.0]
    policy_chosen = t(pc).requires_grad_()
    losses, chosen_rewards, rejected_rewards = dpo_loss(policy_chosen, t(pr), t(rc), t(rr), beta, label_smoothing)
    for i in range(3):
        margin = beta * ((pc[i] - rc[i]) - (pr[i] - rr[i]))
        expected = (1 - label_smoothing) * neg_logsigmoid(margin) + label_smoothing * neg_logsigmoid(-margin)
        assert losses[i].item() == pytest.approx(expected, rel=1e-12)
        assert chosen_rewards[i].item() == pytest.approx(beta * (pc[i] - rc[i]), rel=1e-12)
        assert rejected_rewards[i].item() == pytest.approx(beta * (pr[i] - rr[i]), rel=1e-12)
    assert losses.requires_grad and not chosen_rewards.requires_grad and not rejected_rewards.requires_grad


def test_pairwise_reward_loss_matches_the_scalar_formula():
    chosen, rejected = [1.0, -2.0, 0.0], [0.5, 3.0, 0.0]
    assert_close(pairwise_reward_loss(t(chosen), t(rejected)),
                 [neg_logsigmoid(c - r) for c, r in zip(chosen, rejected)])


def test_last_token_scores_never_read_padding():
    values = t([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0], [5.0, 6.0, 7.0, 8.0]])
    mask = prefix_mask([3, 1, 4], 4)
    assert_close(last_token_scores(values, mask), [3.0, 4.0, 8.0])
    with pytest.raises(ValueError, match="row 1"):
        last_token_scores(values, prefix_mask([3, 0, 4], 4))


def test_diverging_reward_loss_averages_from_the_first_difference_to_the_longer_end():
    width = 6
    chosen_tokens = torch.tensor([[5, 6, 7, 8, 0, 0], [5, 6, 7, 0, 0, 0], [5, 6, 0, 0, 0, 0]])
    rejected_tokens = torch.tensor([[5, 6, 9, 8, 4, 0], [5, 6, 7, 0, 0, 0], [5, 6, 7, 8, 0, 0]])
    chosen_lengths, rejected_lengths = [4, 3, 2], [5, 3, 4]
    g = torch.Generator().manual_seed(1)
    chosen_values, rejected_values = torch.randn(3, width, generator=g, dtype=F64), torch.randn(3, width,
                                                                                                generator=g, dtype=F64)
    losses = diverging_reward_loss(chosen_values, rejected_values, prefix_mask(chosen_lengths, width),
                                   prefix_mask(rejected_lengths, width), chosen_tokens, rejected_tokens)
    # Windows by hand: pair 0 differs at 2, ends at 5; pair 1 is identical (its last real token, 2);
    # pair 2's chosen ends where rejected goes on: 2..4.
    for b, (start, end) in enumerate([(2, 5), (2, 3), (2, 4)]):
        terms = [neg_logsigmoid(chosen_values[b, i].item() - rejected_values[b, i].item()) for i in range(start, end)]
        assert losses[b].item() == pytest.approx(sum(terms) / len(terms), rel=1e-12)
    with pytest.raises(ValueError, match="pair 1"):
        diverging_reward_loss(chosen_values, rejected_values, prefix_mask([4, 0, 2], width),
                              prefix_mask([5, 0, 4], width), chosen_tokens, rejected_tokens)


def test_grpo_advantages_normalize_within_groups():
    rewards = [1.0, 0.0, 0.0, 0.1, 0.1, 0.1, 2.0, 4.0, 9.0]
    batch_std = statistics.stdev(rewards)
    expected = {"group": [], "none": [], "batch": []}
    for g in range(3):
        group = rewards[3 * g:3 * g + 3]
        mean, std = statistics.fmean(group), statistics.stdev(group)  # stdev: n - 1
        equal = len(set(group)) == 1
        expected["group"] += [0.0 if equal else (r - mean) / (std + 1e-6) for r in group]
        expected["none"] += [0.0 if equal else r - mean for r in group]
        expected["batch"] += [0.0 if equal else (r - mean) / (batch_std + 1e-6) for r in group]
    scaled = grpo_advantages(t(rewards), 3)
    assert_close(scaled, expected["group"])
    assert scaled[3:6].tolist() == [0.0, 0.0, 0.0]  # exactly, though mean(0.1, 0.1, 0.1) != 0.1 in floats
    assert_close(grpo_advantages(t(rewards), 3, scale="none"), expected["none"])
    assert_close(grpo_advantages(t(rewards), 3, scale="batch", batch_std=batch_std), expected["batch"])
    assert grpo_advantages(t(rewards), 1).tolist() == [0.0] * 9
    assert grpo_advantages(torch.tensor([1, 0]), 2).dtype.is_floating_point
    assert equal_reward_groups(t(rewards), 3).tolist() == [False, True, False]
    with pytest.raises(ValueError, match=r"9 rewards.*group_size=4"):
        grpo_advantages(t(rewards), 4)
    with pytest.raises(ValueError, match="batch_std"):
        grpo_advantages(t(rewards), 3, scale="batch")
    with pytest.raises(ValueError, match="'std'"):
        grpo_advantages(t(rewards), 3, scale="std")


def test_rloo_advantages_subtract_the_mean_of_the_other_samples():
    rewards = [1.0, 0.0, 0.5, 0.5, 3.0, -1.0, 2.0, 0.0, 0.1, 0.1, 0.1, 0.1]
    expected = []
    for g in range(3):
        group = rewards[4 * g:4 * g + 4]
        for i, r in enumerate(group):
            others = [v for j, v in enumerate(group) if j != i]
            expected.append(r - sum(others) / len(others))
    advantages = rloo_advantages(t(rewards), 4)
    assert_close(advantages, expected)
    assert advantages[8:].tolist() == [0.0] * 4  # exactly: 0.1 - (0.4 - 0.1) / 3 is not 0 in floats
    with pytest.raises(ValueError, match="group_size >= 2"):
        rloo_advantages(t(rewards), 1)


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_reinforce_pp_returns_sum_the_k1_shaped_rewards_to_the_end(kl_coef):
    logp = t([[-1.0, -2.0, -0.5, -1.0], [-0.1, -0.2, 9.0, 9.0], [5.0, 5.0, 5.0, 5.0]])
    ref = t([[-1.5, -1.0, -0.5, -2.0], [-0.3, -0.1, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    lengths, scores = [4, 2, 0], [2.0, -0.5, 3.0]
    returns = reinforce_pp_returns(t(scores), prefix_mask(lengths, 4), logp, ref, kl_coef)
    for b, n in enumerate(lengths):
        step_rewards = [-kl_coef * (logp[b, i].item() - ref[b, i].item()) + (scores[b] if i == n - 1 else 0.0)
                        for i in range(n)]
        expected = [sum(step_rewards[i:]) for i in range(n)] + [0.0] * (4 - n)
        assert returns[b].tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    with pytest.raises(ValueError, match="ref_logp"):
        reinforce_pp_returns(t(scores), prefix_mask(lengths, 4), None, None, 0.1)


def test_soft_overlong_penalty_is_dapos_piecewise_linear_punishment():
    max_len, buffer, factor = 10, 4, 0.5
    lengths = [1, 6, 7, 9, 10, 12]
    expected = []
    for n in lengths:  # DAPO eq. 13, scaled by the factor
        if n <= max_len - buffer:
            expected.append(0.0)
        elif n <= max_len:
            expected.append(factor * ((max_len - buffer) - n) / buffer)
        else:
            expected.append(-factor)
    assert soft_overlong_penalty(torch.tensor(lengths), max_len, buffer, factor).tolist() == pytest.approx(expected)
    with pytest.raises(ValueError, match="buffer=0"):
        soft_overlong_penalty(torch.tensor(lengths), max_len, 0)


@pytest.mark.parametrize("clip_high", [None, 0.28])
def test_grpo_loss_adds_k3_to_the_asymmetrically_clipped_surrogate(clip_high):
    clip, beta = 0.2, 0.04
    high = clip if clip_high is None else clip_high
    logp = [[-1.0, -0.5, -2.0, math.log(1.25)], [-0.3, -1.2, -0.8, math.log(0.7)]]
    old = [[-1.2, -0.5, -1.0, 0.0], [-0.3, -2.0, -0.1, 0.0]]
    ref = [[-0.8, -1.5, -2.0, -1.0], [-1.0, -1.0, -1.0, -1.0]]
    advantages = [0.5, -1.5]
    loss, low_flags, high_flags = grpo_loss(t(logp), t(old), t(ref), t(advantages), clip, beta, clip_high=clip_high)
    without_kl, _, _ = grpo_loss(t(logp), t(old), None, t(advantages), clip, 0.0, clip_high=clip_high)
    for b in range(2):
        for i in range(4):
            ratio, a = math.exp(logp[b][i] - old[b][i]), advantages[b]
            clipped_term = min(max(ratio, 1 - clip), 1 + high) * a
            surrogate = -min(ratio * a, clipped_term)
            k3 = math.exp(ref[b][i] - logp[b][i]) - (ref[b][i] - logp[b][i]) - 1
            assert loss[b, i].item() == pytest.approx(surrogate + beta * k3, rel=1e-12, abs=1e-12)
            assert without_kl[b, i].item() == pytest.approx(surrogate, rel=1e-12, abs=1e-12)
            assert high_flags[b, i].item() == (a > 0 and ratio > 1 + high)
            assert low_flags[b, i].item() == (a < 0 and ratio < 1 - clip)
    # ratio 1.25 with A > 0 is clipped by 0.2, not by 0.28
    assert high_flags[0, 3].item() == (clip_high is None)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(t(logp), t(old), None, t(advantages), clip, beta)


def test_gspo_clips_the_geometric_mean_ratio_of_each_sequence():
    clip, clip_high = 0.1, 0.15
    lengths = [3, 2, 1]
    logp_rows = [[-1.0, -0.5, -2.0, 7.0], [-0.3, -1.0, 5.0, 5.0], [-0.9, 3.0, 3.0, 3.0]]
    old_rows = [[-1.1, -0.6, -2.1, 0.0], [0.2, -0.1, 0.0, 0.0], [-1.2, 0.0, 0.0, 0.0]]
    advantages = [0.7, -0.4, 1.2]
    logp = t(logp_rows).requires_grad_()
    mask = prefix_mask(lengths, 4)
    loss, low_flags, high_flags = grpo_loss(logp, t(old_rows), None, t(advantages), clip, 0.0, clip_high=clip_high,
                                            mask=mask, sequence=True)
    weights = grpo_token_weights(mask, "gspo", sequences=3, tokens=6, max_len=4, world=1)
    (loss * weights).sum().backward()
    expected_total, expected_grad = 0.0, torch.zeros(3, 4, dtype=F64)
    for b, n in enumerate(lengths):
        log_ratios = [logp_rows[b][i] - old_rows[b][i] for i in range(n)]
        s = math.exp(sum(log_ratios) / n)  # (prod of token ratios)^(1/n)
        a = advantages[b]
        clipped = min(max(s, 1 - clip), 1 + clip_high) * a
        seq_loss = -min(s * a, clipped)
        expected_total += seq_loss / 3
        is_clipped = clipped < s * a
        for i in range(n):
            assert loss[b, i].item() == pytest.approx(seq_loss, rel=1e-12)
            assert high_flags[b, i].item() == (is_clipped and s > 1) and low_flags[b, i].item() == (is_clipped and s < 1)
            # d(-s a / 3)/d logp_i = -a s / (3 n) unless the clipped (constant) term is the smaller objective
            expected_grad[b, i] = 0.0 if is_clipped else -a * s / (3 * n)
    assert (loss * weights).sum().item() == pytest.approx(expected_total, rel=1e-12)
    assert_close(logp.grad, expected_grad)
    # one sequence of each kind: inside the range (s = e^0.1), clipped below (e^-0.7, A < 0), above (e^0.3, A > 0)
    assert [low_flags[b, 0].item() for b in range(3)] == [False, True, False]
    assert [high_flags[b, 0].item() for b in range(3)] == [False, False, True]
    with pytest.raises(ValueError, match="mask"):
        grpo_loss(logp, t(old_rows), None, t(advantages), clip, 0.0, sequence=True)


def test_grpo_token_weights_aggregate_as_trl_and_global_ones_do_not_depend_on_the_split():
    g = torch.Generator().manual_seed(3)
    lengths, max_len = [4, 1, 0, 3, 2, 4], 5  # row 2: a masked (truncated) row, still a sequence
    mask = prefix_mask(lengths, 5)
    losses = torch.randn(6, 5, generator=g, dtype=F64)
    rows = [[losses[b, i].item() for i in range(n)] for b, n in enumerate(lengths)]
    n_seq, n_tok = len(lengths), sum(lengths)
    expected = {
        "grpo": sum(sum(r) / len(r) for r in rows if r) / n_seq,
        "dapo": sum(sum(r) for r in rows) / n_tok,
        "dr_grpo": sum(sum(r) for r in rows) / (n_seq * max_len),
    }
    expected["gspo"] = expected["grpo"]
    halves = ([0, 1, 2], [3, 4, 5])
    # bnpo on two ranks: each rank's token mean, averaged over the ranks
    expected["bnpo"] = sum(sum(sum(rows[b]) for b in rank) / sum(lengths[b] for b in rank) for rank in halves) / 2
    for loss_type in GRPO_LOSS_TYPES:
        if loss_type != "bnpo":
            one = (losses * grpo_token_weights(mask, loss_type, n_seq, n_tok, max_len, world=1)).sum()
            assert one.item() == pytest.approx(expected[loss_type], rel=1e-12), loss_type
        two = sum((losses[rank] * grpo_token_weights(mask[rank], loss_type, n_seq, n_tok, max_len, world=2)).sum()
                  for rank in halves)
        assert two.item() == pytest.approx(expected[loss_type], rel=1e-12), loss_type
    with pytest.raises(ValueError, match="'token'"):
        grpo_token_weights(mask, "token", n_seq, n_tok, max_len, world=1)
