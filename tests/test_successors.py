"""CISPO, SAPO, GMPO, LUSPO and VESPO: against TRL 1.16's own _compute_loss (CISPO, SAPO, LUSPO, VESPO), against
GMPO's equation written out here and against verl's `geo_mean` (GMPO), and the properties each paper states."""

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import metrics as diagnostics
import losses
from losses import PRESETS, StepNorm

T = 7
LENGTHS = [3, 7, 2, 5, 4, 6]  # unequal lengths


pytestmark = pytest.mark.usefixtures("float64")  # conftest: exact comparisons in double precision


def batch(shift: float, seed: int = 0):
    """Off-policy rows (log-ratios of spread `shift`, both signs), unequal lengths, both advantage signs."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in LENGTHS])
    old = -torch.rand(len(LENGTHS), T, generator=gen) * 3
    logp = old + shift * torch.randn(len(LENGTHS), T, generator=gen)
    adv = torch.tensor([1.2, -0.7, 0.3, -1.5, 0.9, -0.2])
    return logp, old, adv, mask


def ours(cfg, logp, old, adv, mask, max_new=T):
    x = logp.clone().requires_grad_(True)
    loss = losses.policy_loss(x, old, adv, mask, StepNorm.of(mask, max_new), cfg)
    loss.backward()
    return loss.item(), x.grad


def trl_stand_in(loss_type: str, level: str = "token", bias_correction_kl: bool = False, args: dict | None = None,
                 **config):
    """A stand-in for TRL 1.16's GRPOTrainer that holds only what its _compute_loss reads (its forward pass is set
    by the caller: `_get_per_token_logps_and_entropies`). `args`: TrainingArguments fields; `config`: the trainer's."""
    from trl import GRPOTrainer

    fake = SimpleNamespace(
        args=SimpleNamespace(**{"sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05, "delta": None,
                                "use_bias_correction_kl": bias_correction_kl, "steps_per_generation": 1,
                                **(args or {})}),
        loss_type=loss_type, importance_sampling_level=level, off_policy_mask_threshold=None, aux_loss_enabled=False,
        current_gradient_accumulation_steps=1, max_completion_length=T, model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(num_processes=1, gather=lambda t: t, reduce=lambda t, *a, **k: t,
                                    pad_across_processes=lambda t, **k: t, sync_gradients=True),
        _metrics={"train": __import__("collections").defaultdict(list)}, router_aux_loss_coef=0.0,
        **{"beta": 0.0, "use_vllm": False, "top_entropy_quantile": 1.0, "_entropy_bonus_enabled": False,
           "entropy_coef": 0.0, "use_adaptive_entropy": False, **config})
    fake.get_high_entropy_mask = lambda e, m, t: GRPOTrainer.get_high_entropy_mask(fake, e, m, t)
    return fake


def trl_loss(fake, logp, old, adv, mask, extra_inputs=None, entropy_fn=None):
    """fake's _compute_loss (TRL's own) on our log-probs: (the loss, d loss / d logp)."""
    from trl import GRPOTrainer

    x = logp.clone().requires_grad_(True)
    fake._get_per_token_logps_and_entropies = lambda *a, **k: (x, (entropy_fn or torch.zeros_like)(x), None)
    rows = len(mask)
    inputs = {"prompt_ids": torch.zeros(rows, 1, dtype=torch.long), "prompt_mask": torch.ones(rows, 1, dtype=torch.long),
              "completion_ids": torch.zeros(rows, T, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old, "num_items_in_batch": mask.sum(), **(extra_inputs or {})}
    loss = GRPOTrainer._compute_loss(fake, None, inputs)
    loss.backward()
    return loss.item(), x.grad


def trl(loss_type: str, logp, old, adv, mask, _extra_inputs=None, _level="token", _bias_correction_kl=False,
        _entropy_fn=None, **config):
    """TRL 1.16's GRPOTrainer._compute_loss itself on a fresh stand-in (trl_stand_in): (loss, gradient)."""
    return trl_loss(trl_stand_in(loss_type, _level, _bias_correction_kl, **config), logp, old, adv, mask,
                    _extra_inputs, _entropy_fn)


@pytest.mark.parametrize("shift", [0.0, 0.05, 1.5])  # on-policy; mildly stale; stale enough to cap and gate
def test_cispo_and_sapo_equal_trl(shift):
    logp, old, adv, mask = batch(shift)
    for name, trl_config in (("cispo", {"epsilon_low": 1.0, "epsilon_high": 1 + PRESETS["cispo"].epsilon_high}),
                             ("sapo", {"epsilon_low": 0.2, "epsilon_high": 0.2})):
        try:
            theirs = trl(name, logp, old, adv, mask, **trl_config)
        except (AttributeError, KeyError) as e:  # TRL read something the stand-in lacks: say what, do not pass
            raise AssertionError(f"the stand-in for TRL's trainer lacks {e}") from e
        mine = ours(PRESETS[name], logp, old, adv, mask)
        assert mine[0] == pytest.approx(theirs[0], rel=1e-12, abs=1e-14), name
        assert torch.allclose(mine[1], theirs[1], rtol=1e-10, atol=1e-14), name
    if shift == 1.5:  # the comparison saw CISPO's cap at work, not only the on-policy identity
        assert (torch.exp(logp - old)[mask > 0] > 1 + PRESETS["cispo"].epsilon_high).any()


@pytest.mark.parametrize("shift", [0.0, 0.05, 1.5])
def test_luspo_and_vespo_equal_trl(shift):
    """LUSPO against TRL's loss_type "luspo" at sequence level, VESPO against "vespo" (its get_gamma_weights, the
    paper's k and lambda), in loss and gradient."""
    from trl import GRPOTrainer

    logp, old, adv, mask = batch(shift)
    luspo = trl("luspo", logp, old, adv, mask, _level="sequence", epsilon_low=PRESETS["luspo"].epsilon,
                epsilon_high=PRESETS["luspo"].epsilon_high)
    cfg = PRESETS["vespo"]
    fake = trl_stand_in("vespo", args={"vespo_k_pos": cfg.vespo_k_pos, "vespo_lambda_pos": cfg.vespo_lambda_pos,
                                       "vespo_k_neg": cfg.vespo_k_neg, "vespo_lambda_neg": cfg.vespo_lambda_neg},
                        epsilon_low=0.2, epsilon_high=0.2)
    fake.get_gamma_weights = GRPOTrainer.get_gamma_weights
    vespo = trl_loss(fake, logp, old, adv, mask)
    for name, theirs in (("luspo", luspo), ("vespo", vespo)):
        mine = ours(PRESETS[name], logp, old, adv, mask)
        assert mine[0] == pytest.approx(theirs[0], rel=1e-12, abs=1e-14), name
        assert torch.allclose(mine[1], theirs[1], rtol=1e-10, atol=1e-14), name
    phi = losses.vespo_weight(logp - old, adv.unsqueeze(-1), mask, 2.0, 3.0, 3.0, 2.0)
    if shift == 0.0:
        assert torch.equal(phi, torch.ones_like(phi))  # on-policy: W = 1, phi(1) = 1
    if shift == 1.5:  # the comparison saw the kernel damp some sequences and the clip bind on some
        assert (phi < 0.5).any() and (phi > 0.5).any()
        assert losses.ratio_diagnostics(logp, old, adv, mask, PRESETS["luspo"])["clip/seq_frac"] > 0


def test_the_defaults_are_trl_1_16s():
    """LossConfig's and AdaptiveEntropy's defaults are GRPOConfig's in TRL 1.16: epsilon (TRL's epsilon_high None
    means epsilon), beta, SAPO's temperatures, VESPO's kernel, the 80/20 quantile, the entropy bonus and the adaptive
    control's step and range (train.py's --entropy-target sets only its target)."""
    import dataclasses

    from trl import GRPOConfig

    trl = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    ours, control = losses.LossConfig(), losses.AdaptiveEntropy(0.0, 0.2)
    assert trl["epsilon_high"] is None and (ours.epsilon, ours.epsilon_high, ours.beta) == \
        (trl["epsilon"], trl["epsilon"], trl["beta"])
    assert (ours.sapo_tau_pos, ours.sapo_tau_neg) == (trl["sapo_temperature_pos"], trl["sapo_temperature_neg"])
    vespo = ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
    assert tuple(getattr(ours, k) for k in vespo) == tuple(trl[k] for k in vespo)
    assert (ours.top_entropy_quantile, ours.entropy_coef) == (trl["top_entropy_quantile"], trl["entropy_coef"])
    assert (control.delta, control.low, control.high) == \
        (trl["entropy_coef_delta"], trl["entropy_coef_min"], trl["entropy_coef_max"])


def test_luspo_is_gspo_with_each_sequence_counted_by_its_length():
    logp, old, adv, mask = batch(0.05, seed=5)
    for i in range(len(LENGTHS)):  # one sequence at a time: LUSPO's loss is |y_i| times GSPO's
        row = slice(i, i + 1)
        gspo, luspo = (ours(PRESETS[a], logp[row], old[row], adv[row], mask[row]) for a in ("gspo", "luspo"))
        assert luspo[0] == pytest.approx(LENGTHS[i] * gspo[0], rel=1e-12)
        assert torch.allclose(luspo[1], LENGTHS[i] * gspo[1], rtol=1e-12, atol=1e-15)


def test_vespo_kernel_is_one_on_policy_peaks_at_k_over_lambda_and_vanishes_far_away():
    mask = torch.ones(1, 1)
    for adv, (k, lam) in ((1.0, (2.0, 3.0)), (-1.0, (3.0, 2.0))):
        def phi(w):
            return losses.vespo_weight(torch.tensor([[math.log(w)]]), torch.tensor([[adv]]), mask, 2.0, 3.0, 3.0,
                                       2.0).item()
        assert phi(1.0) == pytest.approx(1.0)
        peak = k / lam
        assert phi(peak) > max(phi(peak * 0.9), phi(peak * 1.1), 1.0)  # its maximum, above the on-policy weight
        assert phi(peak) == pytest.approx(math.exp(lam + k * math.log(peak) - k))
        assert phi(1e-4) < 1e-6 and phi(20.0) < 1e-6  # a sequence far from pi_old, either way, gets no gradient
        floor = math.exp(lam + k * math.log(1e-8) - lam * 1e-8)  # as TRL, log W is bounded below at log 1e-8
        assert phi(1e-12) == pytest.approx(floor, rel=1e-9, abs=0) and floor > 0


def test_cispo_keeps_every_token_in_the_gradient_where_ppo_drops_clipped_ones():
    logp, old, adv, mask = batch(0.6, seed=1)
    _, g_cispo = ours(PRESETS["cispo"], logp, old, adv, mask)
    _, g_ppo = ours(replace(PRESETS["dapo"], epsilon_high=0.2), logp, old, adv, mask)
    live = (mask > 0) & (adv.unsqueeze(-1) != 0)
    assert (g_cispo[live] != 0).all()  # every token with A != 0
    assert (g_ppo[live] == 0).any()  # PPO's clip zeroes some of the same tokens


def test_sapo_gate_tends_to_a_hard_window_as_tau_grows():
    w = torch.tensor([0.5, 0.79, 0.95, 1.0, 1.05, 1.21, 2.0])
    adv = torch.ones_like(w)
    for tau in (1.0, 10.0, 100.0):
        slope = losses.sapo_gate_slope(w, adv, replace(PRESETS["sapo"], sapo_tau_pos=tau))
        assert slope[3] == pytest.approx(1.0)  # f'(1) = 1: on-policy gradient untouched at any tau
    steep = losses.sapo_gate_slope(w, adv, replace(PRESETS["sapo"], sapo_tau_pos=1000.0))
    assert (steep[[0, 1, 5, 6]] < 1e-6).all()  # outside PPO's [0.8, 1.2], no gradient: the hard clip's behaviour
    mild = losses.sapo_gate_slope(w, adv, PRESETS["sapo"])
    assert (mild > 0.5).all()  # at tau 1 the gate only tapers


def gmpo_paper(logp, old, adv, mask, eps):
    """GMPO's objective as the paper writes it (2507.20673 eq. 4), as a product, sequence by sequence:
    (prod_t min(rho_t A, clip(rho_t, e^-eps, e^eps) A)^(1/|y|) for A > 0, the max (the sign-aware min) for A < 0."""
    total = 0.0
    for i in range(len(LENGTHS)):
        n = int(mask[i].sum())
        rho = torch.exp(logp[i, :n] - old[i, :n])
        clipped = torch.clamp(rho, math.exp(-eps), math.exp(eps))
        keep = torch.minimum(rho, clipped) if adv[i] > 0 else torch.maximum(rho, clipped)
        total = total + torch.prod(keep) ** (1 / n) * adv[i]
    return -total / len(LENGTHS)


def gmpo_verl(logp, old, adv, mask, eps):
    """verl's `geo_mean` policy loss as it computes it: sign-aware clamp of the token log-ratio, exp of its masked
    mean (+1e-8 in the denominator), times the token-averaged advantage, mean over sequences."""
    adv_tok = adv.unsqueeze(-1).expand_as(logp)
    l = logp - old
    sgn = torch.sign(adv_tok)
    lmin = sgn * torch.min(sgn * l, sgn * torch.clamp(l, -eps, eps))
    ratio = torch.exp((lmin * mask).sum(-1) / (mask.sum(-1) + 1e-8))
    a = (adv_tok * mask).sum(-1) / (mask.sum(-1) + 1e-8)
    return torch.mean(-a * ratio)


@pytest.mark.parametrize("shift", [0.05, 0.6])
def test_gmpo_equals_its_equation_and_verls_geo_mean(shift):
    logp, old, adv, mask = batch(shift, seed=2)
    cfg = PRESETS["gmpo"]
    loss, grad = ours(cfg, logp, old, adv, mask)
    for reference, tol in ((gmpo_paper, 1e-14), (gmpo_verl, 1e-8)):  # verl adds 1e-8 to each length
        x = logp.clone().requires_grad_(True)
        value = reference(x, old, adv, mask, cfg.epsilon)
        value.backward()
        assert loss == pytest.approx(value.item(), abs=tol), reference.__name__
        assert torch.allclose(grad, x.grad, rtol=0, atol=tol), reference.__name__
    if shift == 0.6:  # some tokens were clipped, and they get no gradient
        clipped = (losses.gmpo_log_ratio(logp - old, adv.unsqueeze(-1).expand_as(logp), 0.4, 0.4) != logp - old)
        assert (clipped & (mask > 0)).any() and (grad[clipped & (mask > 0)] == 0).all()


def test_gmpo_equals_gspo_when_nothing_clips():
    logp, old, adv, mask = batch(0.02, seed=3)  # every |log-ratio| well inside 0.4
    wide_gspo = replace(PRESETS["gspo"], epsilon=10.0, epsilon_high=10.0)  # GSPO with its clip out of the way
    g_loss, g_grad = ours(PRESETS["gmpo"], logp, old, adv, mask)
    s_loss, s_grad = ours(wide_gspo, logp, old, adv, mask)
    assert g_loss == pytest.approx(s_loss, rel=1e-13) and torch.allclose(g_grad, s_grad, rtol=1e-12, atol=1e-15)


def test_combinations_the_maths_does_not_define_are_refused():
    """check_config runs once at start-up (flags.validate; test_bad_input.py checks the one-line errors)."""
    logp, old, adv, mask = batch(0.1)
    with pytest.raises(ValueError, match="CISPO .* use --importance-sampling-level token"):
        losses.check_config(replace(PRESETS["cispo"], importance_sampling_level="sequence"))
    with pytest.raises(ValueError, match="GMPO's weight is one per sequence"):
        losses.check_config(replace(PRESETS["gmpo"], importance_sampling_level="token"))
    with pytest.raises(ValueError, match="VESPO computes its own weight"):
        losses.check_config(replace(PRESETS["vespo"], importance_sampling_level="sequence"))
    with pytest.raises(ValueError, match="VESPO's kernel needs lambda > 0"):
        losses.check_config(replace(PRESETS["vespo"], vespo_lambda_pos=0.0))
    # SAPO's gate is defined on any ratio: at sequence level it gates GSPO's s_i
    losses.check_config(replace(PRESETS["sapo"], importance_sampling_level="sequence"))
    ours(replace(PRESETS["sapo"], importance_sampling_level="sequence"), logp, old, adv, mask)


def test_shadow_fractions_name_what_each_successor_does():
    logp, old, adv, mask = batch(0.6, seed=4)
    diag = diagnostics.study_metrics(logp, old, adv, mask)
    rho = torch.exp(logp - old)
    valid = mask > 0
    capped = ((rho > 5) | (rho < 0)) & valid
    assert diag["clip/shadow_cispo"] == pytest.approx(float(capped.sum() / valid.sum()))
    assert 0 < diag["clip/shadow_sapo"] < 1 and 0 < diag["clip/shadow_gmpo"] < 1
    assert 0 < diag["clip/sapo_gate_mean"] < 1
    on = diagnostics.study_metrics(old, old, adv, mask)
    assert on["clip/sapo_gate_mean"] == pytest.approx(1.0) and on["clip/shadow_sapo"] == 0.0


def test_every_surrogate_has_its_clip_rule():
    """clip_fraction_of answers for each --surrogate at a level it accepts, and names each one that is not PPO's clip
    (clip, clip_cov), so a surrogate added without its rule, which would be read with PPO's clip, fails here."""
    import inspect
    import typing

    logp, old, adv, mask = batch(0.6, seed=4)
    log_ratio, adv_tok = (logp - old) * mask, adv.unsqueeze(-1).expand_as(logp)
    source = inspect.getsource(losses.clip_fraction_of)
    for surrogate in typing.get_args(losses.Surrogate):
        level = "sequence" if surrogate == "gmpo" else "token"
        frac = losses.clip_fraction_of(replace(PRESETS["grpo"], surrogate=surrogate, importance_sampling_level=level),
                                       log_ratio, adv_tok, mask)
        assert 0 <= frac <= 1, surrogate
        assert surrogate in ("clip", "clip_cov") or f'cfg.surrogate == "{surrogate}"' in source, surrogate


def test_gmpo_counts_clipped_tokens_by_the_sign_of_a_and_never_a_zero_advantage():
    """GMPO clips l_it above eps_high where A > 0 and below -eps_low where A < 0, PPO's rule in log space. A row whose
    advantage is 0 (a group with equal rewards) has no side to clip: it counts in the denominator only (sgn(0) = 0
    zeroes its l'_it, which once counted every such token as clipped)."""
    logp, old, adv, mask = batch(0.6, seed=4)
    l = (logp - old) * mask
    adv_tok = adv.unsqueeze(-1).expand_as(l)
    cfg = PRESETS["gmpo"]
    by_hand = (((adv_tok > 0) & (l > cfg.epsilon_high)) | ((adv_tok < 0) & (l < -cfg.epsilon))) & (mask > 0)
    diag = losses.ratio_diagnostics(logp, old, adv, mask, cfg)
    assert 0 < diag["clip/frac"] == pytest.approx(float(by_hand.sum() / mask.sum()))
    assert diagnostics.study_metrics(logp, old, adv, mask)["clip/shadow_gmpo"] == diag["clip/frac"]
    zero = adv.clone()
    zero[:] = 0.0  # every group's rewards equal: nothing is clipped, however far the ratios have moved
    assert losses.ratio_diagnostics(logp, old, zero, mask, cfg)["clip/frac"] == 0.0


def test_vespo_clip_fraction_counts_the_sequences_its_kernel_leaves_under_half_their_gradient():
    logp, old, adv, mask = batch(0.6, seed=4)
    adv = torch.cat([torch.zeros(1), adv[1:]])  # A = 0 (an all-equal group) takes the A >= 0 kernel, as TRL's
    log_w = ((logp - old) * mask).sum(-1)  # (B,) log of each sequence's whole ratio
    k = torch.where(adv >= 0, 2.0, 3.0)
    lam = torch.where(adv >= 0, 3.0, 2.0)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))  # the kernel, by hand
    diag = losses.ratio_diagnostics(logp, old, adv, mask, PRESETS["vespo"])
    assert diag["clip/frac"] == pytest.approx(float((phi < 0.5).sum()) / len(LENGTHS))
    assert 0 < diag["clip/frac"] < 1  # some sequences damped, not all
    assert diag["clip/vespo_phi_mean"] == pytest.approx(float(phi.mean()))


# ---------------------------------------------------------------------------------------------------------------
# Rollout correction: w = pi_old / mu, as TRL 1.16's vLLM importance-sampling correction
# ---------------------------------------------------------------------------------------------------------------

MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def trl_is_ratio(old, sampled, mask, mode, c_min, c_max):
    """TRL 1.16's ratio, transcribed from GRPOTrainer._generate_and_score_completions (its one place)."""
    diff = (old - sampled) * mask
    diff = diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=c_min, max=c_max)
    low, high = (-math.inf if c_min is None else c_min), (math.inf if c_max is None else c_max)
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("algo", ["grpo", "dapo", "cispo", "sapo"])
def test_rollout_correction_equals_trl(mode, algo):
    """Loss and gradient equal TRL's _compute_loss given its ratio (use_vllm with the correction on), for the
    token-level objectives TRL shares; the bounds bind (a mismatch of spread 0.8 nats, C in [0.5, 3])."""
    logp, old, adv, mask = batch(0.3, seed=2)
    gen = torch.Generator().manual_seed(3)
    sampled = old + 0.8 * torch.randn(old.shape, generator=gen) * mask  # log mu: a sampler that rounds differently
    c_min, c_max = 0.5, 3.0
    w = losses.rollout_correction_weights(old, sampled, mask, mode, c_min, c_max)
    torch.testing.assert_close(w, trl_is_ratio(old, sampled, mask, mode, c_min, c_max), rtol=0, atol=0)
    raw = trl_is_ratio(old, sampled, mask, mode, None, None) if mode.endswith("mask") else torch.exp(
        ((old - sampled) * mask).sum(-1, keepdim=True) if mode.startswith("sequence") else (old - sampled) * mask)
    assert (w != raw).any()  # the bounds were exercised
    cfg = replace(PRESETS[algo], beta=0.04 if algo == "grpo" else 0.0)
    trl_loss = {"grpo": "grpo", "dapo": "dapo", "cispo": "cispo", "sapo": "sapo"}[algo]
    eps = {"cispo": (1.0, 1 + cfg.epsilon_high)}.get(algo, (cfg.epsilon, cfg.epsilon_high))
    ref = old - 0.1 * torch.randn(old.shape, generator=gen)
    x = logp.clone().requires_grad_(True)
    loss = losses.policy_loss(x, old, adv, mask, StepNorm.of(mask, T), cfg, ref_logp=ref, rollout_weight=w)
    loss.backward()
    theirs = trl(trl_loss, logp, old, adv, mask, epsilon_low=eps[0], epsilon_high=eps[1], beta=cfg.beta,
                 use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
                 _extra_inputs={"importance_sampling_ratio": w, "ref_per_token_logps": ref})
    assert loss.item() == pytest.approx(theirs[0], rel=1e-12, abs=1e-14)
    assert torch.allclose(x.grad, theirs[1], rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask"])
def test_vespo_folds_the_rollout_correction_into_its_kernel_as_trl(mode):
    """VESPO with the token-level rollout correction: w = pi_old / mu joins W in log space (the paper's code, TRL's
    get_gamma_weights), it does not multiply the loss; loss and gradient equal TRL's. The mask's w = 0 drops a whole
    sequence (its phi is ~1e-16 or less)."""
    from trl import GRPOTrainer

    logp, old, adv, mask = batch(0.3, seed=2)
    sampled = old + 0.8 * torch.randn(old.shape, generator=torch.Generator().manual_seed(3)) * mask
    w = losses.rollout_correction_weights(old, sampled, mask, mode, 0.5, 3.0)
    cfg = PRESETS["vespo"]
    x = logp.clone().requires_grad_(True)
    loss = losses.policy_loss(x, old, adv, mask, StepNorm.of(mask, T), cfg, rollout_weight=w)
    loss.backward()
    fake = trl_stand_in("vespo", args={"vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0,
                                       "vespo_lambda_neg": 2.0}, epsilon_low=0.2, epsilon_high=0.2, use_vllm=True,
                        vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode)
    fake.get_gamma_weights = GRPOTrainer.get_gamma_weights
    theirs = trl_loss(fake, logp, old, adv, mask, {"importance_sampling_ratio": w})
    assert loss.item() == pytest.approx(theirs[0], rel=1e-12, abs=1e-14)
    assert torch.allclose(x.grad, theirs[1], rtol=1e-10, atol=1e-14)
    plain = ours(cfg, logp, old, adv, mask)
    assert loss.item() != pytest.approx(plain[0], rel=1e-6)  # the correction acted
    if mode == "token_mask":  # a sequence with a masked token has W <= 1e-8, phi ~ e^lambda 1e-8^k: no gradient left
        dropped = ((w == 0) & (mask > 0)).any(-1)
        assert dropped.any() and (x.grad[dropped].abs() < 1e-20).all() and (x.grad[~dropped].abs() > 1e-6).any()
