"""Post-training on one GPU: preference optimisation (DPO and TRL's other preference losses; KTO
on completions each marked desirable or not),
reinforcement learning with verifiable rewards (GRPO) and the token-weighted supervised losses of
dynamic and entropy-adaptive fine-tuning (DFT, EAFT), with megacompile as the trainer. The losses
here are plain torch functions
of log-probabilities, so the engine captures them inside the step like any loss_fn."""
from .advantages import group_advantages
from .dft import DFTObjective, dft_loss
from .eaft import EAFTObjective, eaft_loss, eaft_weights
from .dpo import DPOLoss, DPOObjective, dpo_loss
from .dpo_losses import orpo_metrics
from .grpo import GRPOLoss, GRPOObjective, grpo_loss
from .kto import KTOLoss, KTOObjective, kl_estimate, kto_loss
from .reward import RewardModel, reward_loss
from .logprobs import IGNORE, sequence_logprobs, token_logprobs
from . import reference_sync, rewards, sampling_correction, sampling_filters
from .advantages import decoupled_advantages, decoupled_rewards, nanstd
from .hf_generator import HFGenerator
from .preference_format import trl_record
from .preference import Pair, pack, pack_rows, preference_metrics, read_pairs, to_pair, tokenised
from .record_files import jsonl_records, present
from .rendered import check_calls, check_texts, check_tools, render, texts
from .reward_logs import RewardLogs
from .reward_models import RewardModelFunction
from .rewards import TrainerState
from .rollout import EngineGenerator
from .rollout_batch import rollout_batch, truncated
from .sampling_correction import sampled_logps, sampling_ratio
from .sampling_filters import Filters
from .streamed_copy import StreamedHFGenerator, decoder_layers
from .vllm_generator import MISSING, VLLMGenerator
from .vllm_server import VLLMServerGenerator

__all__ = ["decoupled_advantages", "decoder_layers", "RewardModelFunction", "reference_sync", "decoupled_rewards",
           "DFTObjective", "EAFTObjective", "eaft_loss", "eaft_weights", "Filters", "orpo_metrics",
           "sampling_filters", "dft_loss", "DPOLoss", "DPOObjective", "dpo_loss", "GRPOLoss", "GRPOObjective",
           "group_advantages", "grpo_loss", "KTOLoss", "KTOObjective", "kl_estimate", "kto_loss", "pack_rows",
           "tokenised", "trl_record", "RewardLogs", "RewardModel", "reward_loss", "sequence_logprobs", "token_logprobs",
           "IGNORE",
           "EngineGenerator", "HFGenerator", "MISSING", "Pair", "StreamedHFGenerator", "TrainerState",
           "VLLMGenerator", "VLLMServerGenerator", "nanstd", "pack", "preference_metrics", "read_pairs", "rewards",
           "rollout_batch", "to_pair", "jsonl_records", "present", "check_calls", "check_texts", "check_tools",
           "render", "texts", "sampled_logps", "sampling_correction", "sampling_ratio", "truncated"]
