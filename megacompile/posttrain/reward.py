"""Reward modelling (TRL's RewardTrainer, LlamaFactory's stage rm): a scalar head on the decoder's
last hidden state scores a sequence at its last token, trained on preference pairs by the
Bradley-Terry loss

    loss = -log sigma(r(chosen) - r(rejected) - margin) + c (r(chosen) + r(rejected))^2

averaged over the pairs (margin: a record's own, 0 without; c: TRL's center_rewards_coefficient,
0 without). The model is laid out as transformers' *ForSequenceClassification with one label
(`model`, the decoder; `score`, a bias-free linear map to one number), so its weights are that
class's: the trained reward model loads with AutoModelForSequenceClassification. A vision-language
model's decoder is its whole model (tower, projector and text model), as transformers' sequence
classifier of the family holds it (Gemma 3's), and its rows' image inputs go to it as they are."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..capture import LossAndOutputs
from ..errors import ArgumentError

__all__ = ["RewardModel", "reward_loss"]


def reward_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                center: float = 0.0) -> torch.Tensor:
    """(B,) per-pair losses from (B,) rewards of the chosen and the rejected sequences."""
    gap = chosen - rejected if margin is None else chosen - rejected - margin
    losses = -F.logsigmoid(gap)
    return losses + center * (chosen + rejected) ** 2 if center else losses


class RewardModel(nn.Module):
    """A decoder with a reward head, for compile(): forward(input_ids, last) -> (N,) rewards, each
    row's score at position `last` (its last token: transformers pools at the last token that is
    not padding); forward(input_ids, last, margin) -> the mean loss of a batch packing B chosen
    rows, then the B rejected rows of the same pairs, `margin` (B,) their margins (zeros: none).
    With `hand_out` set, the loss comes as LossAndOutputs(loss, {"rewards": the (2B,) rewards the loss
    read}), for the logged rewards."""

    hand_out = False

    def __init__(self, model: nn.Module, score: nn.Linear, center_rewards_coefficient: float = 0.0):
        super().__init__()
        if score.out_features != 1 or score.bias is not None:
            raise ArgumentError("a reward head maps the hidden state to one number, without a bias "
                                "(transformers' score of a one-label sequence classifier)")
        self.model, self.score, self.center = model, score, center_rewards_coefficient

    @classmethod
    def of(cls, causal_lm: nn.Module, seed: int = 0, center_rewards_coefficient: float = 0.0) -> "RewardModel":
        """The decoder of a causal LM (its lm_head left out) with a new head, initialised as
        transformers initialises a classifier's score: normal(0, initializer_range), seeded."""
        config = causal_lm.config.get_text_config()      # a vision-language model's: its text model's
        decoder = getattr(causal_lm, causal_lm.base_model_prefix)
        score = nn.Linear(config.hidden_size, 1, bias=False)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            std = getattr(config, "initializer_range", None) or getattr(causal_lm.config, "initializer_range", 0.02)
            score.weight.normal_(0.0, std, generator=generator)
        out = cls(decoder, score, center_rewards_coefficient)
        out.stored_as = (type(causal_lm), causal_lm.config)     # its files are the causal LM's (files_like)
        # the causal LM's tensors the reward model has no place for (its head): a file of the causal
        # LM holds them, and loading it passes them over
        kept = {id(p) for p in decoder.parameters()}
        out.left_out = tuple(n for n, p in causal_lm.named_parameters() if id(p) not in kept)
        return out

    def files_like(self) -> nn.Module:
        """The causal LM (on meta) whose files this model's weights are read from: the names an older
        layout stores (a vision-language model's `language_model.model.*`) are renamed by its rules."""
        kind, config = getattr(self, "stored_as", (None, None))
        if kind is None:
            return self
        with torch.device("meta"):
            return kind(config)

    def forward(self, input_ids: torch.Tensor, last: torch.Tensor, margin: torch.Tensor | None = None,
                **media) -> torch.Tensor:
        """`media`: a vision-language model's image inputs for the rows."""
        hidden = self.model(input_ids, use_cache=False, **media).last_hidden_state    # a cache would be an output too
        picked = hidden.gather(1, last.view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])).squeeze(1)
        rewards = self.score(picked).squeeze(-1).float()
        if margin is None:
            return rewards
        half = rewards.shape[0] // 2
        loss = reward_loss(rewards[:half], rewards[half:], margin, self.center).mean()
        return LossAndOutputs(loss, {"rewards": rewards}) if self.hand_out else loss
