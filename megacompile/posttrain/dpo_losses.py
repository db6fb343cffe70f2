"""The preference losses TRL's DPOTrainer takes as `loss_type`, each a function of a batch of B pairs'
sequence log-probabilities (summed over the completion tokens) under the policy and the reference.

With c = log pi(y+) - log pi_ref(y+), r = log pi(y-) - log pi_ref(y-), h = c - r, b = beta,
ls = label_smoothing, sigma the logistic function and n+, n- the completions' token counts:

    sigmoid     -log sigma(b h)                                          DPO (Rafailov et al., 2023)
    hinge       relu(1 - b h)                                            SLiC / RSO
    ipo         (c / n+ - r / n- - 1 / (2 b))^2                          IPO, log-ratios averaged per token
    exo_pair    KL(q || p) over {y+, y-}: q = (sigma(b h), sigma(-b h)),  EXO, ls its epsilon (> 0)
                p = (1 - ls, ls)
    nca_pair    -log sigma(b c) - log sigma(-b c) / 2 - log sigma(-b r) / 2    NCA
    robust      (-(1 - ls) log sigma(b h) + ls log sigma(-b h)) / (1 - 2 ls)   robust DPO
    bco_pair    -log sigma(b c) - log sigma(-b r)                        BCO on pairs
    sppo_hard   (c - 1 / (2 b))^2 + (r + 1 / (2 b))^2                    SPPO, hard probabilities
    aot         -(1 - ls) log sigma(b d) - ls log sigma(-b d), d = sort(log pi(y+) - log pi(y-))
                - sort(log pi_ref(y+) - log pi_ref(y-)) over the batch   AOT, paired
    aot_unpaired  the same with d = sort(c) - sort(r)                    AOT, unpaired (TRL's old aot_pair)
    apo_zero    1 - sigma(b c) + sigma(b r)                              APO
    apo_down    sigma(b c) + 1 - sigma(b h)                              APO
    discopop    -log sigma(b h) (1 - m) + exp(-b h) m, m = sigma(b h / tau)    DiscoPOP
    sigmoid_norm  -log sigma(b (c / n+ - r / n-))                        sigmoid on per-token log-ratios
    sft         -sum(log pi(y+)) / sum(n+): the chosen tokens' mean negative log-likelihood (RPO's term)
    simpo       -log sigma(b (a+ - a-) - gamma), a = log pi(y) / n, no reference   SimPO (TRL's CPO loss_type)
    orpo        the sft term - b log sigma(log(a+ odds) - log(a- odds)), odds(a) = e^a / (1 - e^a),
                no reference                                              ORPO (TRL's ORPOTrainer)
    orpo_per_pair  -a+ - b log sigma(the same log odds ratio): the NLL of each pair's chosen answer
                over its own tokens           ORPO as LlamaFactory's pref_loss orpo trains it

simpo and both orpo read the policy alone (as sft does): a run whose loss types are all of these needs
no reference log-probabilities (REFERENCE_FREE). gamma is `simpo_gamma`; orpo's lambda is beta, as
TRL's ORPOConfig and LlamaFactory's pref_beta take it.

f-DPO (Wang et al., 2023; TRL's `f_divergence_type`): the log-ratios c and r are first mapped
through the divergence's f'(e^x): reverse_kl x (DPO itself), forward_kl 1 - e^-x, js_divergence
log 2 + log sigma(x), alpha_divergence (e^((a - 1) x) - 1) / (a - 1) (x, as reverse_kl, where
a = 1; (a - 1) x clamped at 80 first, as TRL does). Only the loss types of h and of per-token
log-ratios take it (F_DIVERGENCE_LOSS_TYPES); the rewards logged stay b times the log-ratios.

Several loss types add up with `loss_weights` (1 each by default): the batch's loss is
sum_k w_k mean_pairs(loss_k), as TRL combines them (MPO). label_smoothing is read by robust,
exo_pair, aot and aot_unpaired only, as in TRL."""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from ..errors import ArgumentError

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sigmoid_norm", "sft", "simpo", "orpo", "orpo_per_pair")
RENAMED = {"aot_pair": "aot_unpaired"}          # TRL's earlier name
READS_LABEL_SMOOTHING = ("robust", "exo_pair", "aot", "aot_unpaired")
NEEDS_TOKEN_COUNTS = ("ipo", "sigmoid_norm", "sft", "simpo", "orpo", "orpo_per_pair")
REFERENCE_FREE = ("sft", "simpo", "orpo", "orpo_per_pair")
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# f-DPO leaves a beta log Z(x) term that cancels only in the difference of the two scores: TRL's list
F_DIVERGENCE_LOSS_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")


def check_f_divergence(kinds: Sequence[str], divergence: str, alpha: float) -> None:
    if divergence not in F_DIVERGENCES:
        raise ArgumentError(f"f_divergence_type must be one of {', '.join(F_DIVERGENCES)}; got {divergence!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ArgumentError(f"f_alpha_divergence_coef must be a number (TRL's 0.5); got {alpha!r}")
    other = [k for k in kinds if k not in F_DIVERGENCE_LOSS_TYPES]
    if divergence != "reverse_kl" and other:
        raise ArgumentError(f"f_divergence_type {divergence} applies to loss types {', '.join(F_DIVERGENCE_LOSS_TYPES)} "
                            f"(f-DPO's log Z term cancels only in their difference of scores), not to "
                            f"{', '.join(other)}: use f_divergence_type reverse_kl with them")


def f_scores(logratio: torch.Tensor, divergence: str = "reverse_kl", alpha: float = 0.5) -> torch.Tensor:
    """The log-ratio mapped through the divergence's f'(e^x) (the module docstring)."""
    if divergence == "reverse_kl" or (divergence == "alpha_divergence" and abs(alpha - 1.0) < 1e-6):
        return logratio
    if divergence == "forward_kl":
        return 1 - torch.exp(-logratio)
    if divergence == "js_divergence":
        return math.log(2) + F.logsigmoid(logratio)
    t = ((alpha - 1.0) * logratio).float().clamp(max=80.0)
    return ((torch.exp(t) - 1.0) / (alpha - 1.0)).to(logratio.dtype)


def loss_types(value) -> tuple[str, ...]:
    """`loss_type` as TRL takes it (one name or a list of them) -> the names, TRL's old names read as
    the new ones."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(x, str) for x in names):
        raise ArgumentError(f"DPO loss_type is one of {', '.join(LOSS_TYPES)} or a list of them; got {value!r}")
    names = tuple(RENAMED.get(x, x) for x in names)
    bad = [x for x in names if x not in LOSS_TYPES]
    if bad:
        raise ArgumentError(f"DPO loss_type must be one of {', '.join(LOSS_TYPES)} (or a list of them); got "
                            f"{', '.join(map(repr, bad))}")
    if len(set(names)) != len(names):
        raise ArgumentError(f"DPO loss_type names a loss twice: {list(names)}")
    return names


def pair_loss(kind: str, c: torch.Tensor, r: torch.Tensor, policy_chosen: torch.Tensor,
              policy_rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, beta: float,
              label_smoothing: float, chosen_tokens: torch.Tensor | None, rejected_tokens: torch.Tensor | None,
              discopop_tau: float, simpo_gamma: float = 0.5) -> torch.Tensor:
    """(B,) losses of one loss type (the module docstring's formulas); c and r the log-ratios."""
    h, ls = c - r, label_smoothing
    if kind == "sigmoid":
        return -F.logsigmoid(beta * h)
    if kind == "hinge":
        return torch.relu(1 - beta * h)
    if kind in ("ipo", "sigmoid_norm"):
        per_token = c / chosen_tokens.clamp(min=1) - r / rejected_tokens.clamp(min=1)
        return (per_token - 1 / (2 * beta)) ** 2 if kind == "ipo" else -F.logsigmoid(beta * per_token)
    if kind == "exo_pair":
        q_chosen, q_rejected = torch.sigmoid(beta * h), torch.sigmoid(-beta * h)
        return (q_chosen * (F.logsigmoid(beta * h) - math.log1p(-ls))
                + q_rejected * (F.logsigmoid(-beta * h) - math.log(ls)))
    if kind == "nca_pair":
        return -F.logsigmoid(beta * c) - 0.5 * F.logsigmoid(-beta * c) - 0.5 * F.logsigmoid(-beta * r)
    if kind == "robust":
        return (-(1 - ls) * F.logsigmoid(beta * h) + ls * F.logsigmoid(-beta * h)) / (1 - 2 * ls)
    if kind == "bco_pair":
        return -F.logsigmoid(beta * c) - F.logsigmoid(-beta * r)
    if kind == "sppo_hard":
        return (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2
    if kind in ("aot", "aot_unpaired"):
        if kind == "aot":
            d = (torch.sort(policy_chosen - policy_rejected, dim=0)[0]
                 - torch.sort(ref_chosen - ref_rejected, dim=0)[0])
        else:
            d = torch.sort(c, dim=0)[0] - torch.sort(r, dim=0)[0]
        return -(1 - ls) * F.logsigmoid(beta * d) - ls * F.logsigmoid(-beta * d)
    if kind == "apo_zero":
        return 1 - torch.sigmoid(beta * c) + torch.sigmoid(beta * r)
    if kind == "apo_down":
        return torch.sigmoid(beta * c) + 1 - torch.sigmoid(beta * h)
    if kind == "discopop":
        m = torch.sigmoid(beta * h / discopop_tau)
        return -F.logsigmoid(beta * h) * (1 - m) + torch.exp(-beta * h) * m
    if kind == "sft":
        return (-policy_chosen.sum() / chosen_tokens.sum().clamp(min=1)).expand_as(c)
    if kind in ("simpo", "orpo", "orpo_per_pair"):
        chosen, rejected = policy_chosen / chosen_tokens.clamp(min=1), policy_rejected / rejected_tokens.clamp(min=1)
        if kind == "simpo":
            return -F.logsigmoid(beta * (chosen - rejected) - simpo_gamma)
        odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
        # TRL averages the NLL over all the batch's chosen tokens; LlamaFactory within each pair
        nll = -chosen if kind == "orpo_per_pair" else -policy_chosen.sum() / chosen_tokens.sum().clamp(min=1)
        return nll - beta * F.logsigmoid(odds)
    raise ArgumentError(f"DPO loss_type must be one of {', '.join(LOSS_TYPES)}; got {kind!r}")


def orpo_metrics(kind: str, policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, chosen_tokens: torch.Tensor,
                 rejected_tokens: torch.Tensor) -> dict[str, float]:
    """ORPO's two terms as their trainers log them: TRL's ORPOTrainer for `orpo` (nll_loss over all
    the batch's chosen tokens, log_odds_ratio = mean log sigma(log odds), log_odds_chosen = the mean
    log odds) and LlamaFactory's for `orpo_per_pair` (sft_loss = each pair's chosen NLL per token,
    odds_ratio_loss = -log sigma(log odds), both averaged over the pairs)."""
    chosen, rejected = policy_chosen / chosen_tokens.clamp(min=1), policy_rejected / rejected_tokens.clamp(min=1)
    odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
    if kind == "orpo":
        return {"nll_loss": (-policy_chosen.sum() / chosen_tokens.sum().clamp(min=1)).item(),
                "log_odds_ratio": F.logsigmoid(odds).mean().item(), "log_odds_chosen": odds.mean().item()}
    return {"sft_loss": (-chosen).mean().item(), "odds_ratio_loss": (-F.logsigmoid(odds)).mean().item()}


def combined_loss(kinds: Sequence[str], weights: Sequence[float] | None, policy_chosen: torch.Tensor,
                  policy_rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, beta: float,
                  label_smoothing: float = 0.0, chosen_tokens: torch.Tensor | None = None,
                  rejected_tokens: torch.Tensor | None = None, discopop_tau: float = 0.05,
                  simpo_gamma: float = 0.5, f_divergence: tuple[str, float] = ("reverse_kl", 0.5)) -> torch.Tensor:
    """(B,) sum_k w_k loss_k: its mean over the pairs is TRL's sum of the weighted means (aot's
    entries follow the sorted order, not the pairs', and so does their sum; the mean is the same)."""
    weights = [1.0] * len(kinds) if weights is None else list(weights)
    if len(weights) != len(kinds):
        raise ArgumentError(f"loss_weights has {len(weights)} weights for {len(kinds)} loss types")
    missing = [k for k in kinds if k in NEEDS_TOKEN_COUNTS]
    if missing and (chosen_tokens is None or rejected_tokens is None):
        raise ArgumentError(f"DPO loss_type {', '.join(missing)} needs the completions' token counts "
                            "(chosen_tokens, rejected_tokens)")
    check_f_divergence(kinds, *f_divergence)
    c, r = f_scores(policy_chosen - ref_chosen, *f_divergence), f_scores(policy_rejected - ref_rejected, *f_divergence)
    total = None
    for kind, w in zip(kinds, weights):
        term = w * pair_loss(kind, c, r, policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta,
                             label_smoothing, chosen_tokens, rejected_tokens, discopop_tau, simpo_gamma)
        total = term if total is None else total + term
    return total
