"""Post-training on one GPU: preference optimisation (DPO and TRL's other preference losses) and
reinforcement learning with verifiable rewards (GRPO), with megacompile as the trainer. The losses
here are plain torch functions of log-probabilities, so the engine captures them inside the step
like any loss_fn."""
from .advantages import group_advantages
from .dpo import DPOLoss, DPOObjective, dpo_loss
from .grpo import GRPOLoss, GRPOObjective, grpo_loss
from .logprobs import sequence_logprobs, token_logprobs

__all__ = ["DPOLoss", "DPOObjective", "dpo_loss", "GRPOLoss", "GRPOObjective", "group_advantages", "grpo_loss", "sequence_logprobs", "token_logprobs"]
