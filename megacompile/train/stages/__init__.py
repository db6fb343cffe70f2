"""`stage: sft | pt | dpo | kto | rm | grpo`: what the run's one loop (train/loop.py) trains, step by step.

    stage.py   what a stage is to the loop
    sft.py     token files, rows, micro-batches, held-out loss and perplexity (stage pt too: its
               records are read as text, data/pretrain.py)
    held_out.py  sft's held-out loss averaged over eval batches as transformers' Trainer averages it
    dpo.py     preference pairs, the reference's log-probabilities, DPO's losses and metrics
    kto.py     completions marked desirable or not, their KL rows, KTO's loss and metrics
    rm.py      a reward model on preference pairs, scored at each row's last token
    reference.py  what dpo and kto share: the reference's log-probabilities kept for a resume,
               the held-out split
    grpo.py    prompts, rollouts scored by reward functions, GRPO's loss
    keys.py    the post-training keys (TRL's names), checked before anything is read
    rollouts.py  who generates GRPO's completions (the engine, a generation copy, vLLM)
    order.py   the seeded order in which a stage reads its pairs or prompts
"""
from __future__ import annotations

from .. import router_loss, vocab
from .stage import Stage


def kind(c) -> type[Stage]:
    """The class of the configured stage (its checks run before any data is read)."""
    if c.stage == "dpo":
        from .dpo import DPOStage
        return DPOStage
    if c.stage == "kto":
        from .kto import KTOStage
        return KTOStage
    if c.stage == "rm":
        from .rm import RMStage
        return RMStage
    if c.stage == "grpo":
        from .grpo import GRPOStage
        return GRPOStage
    from .sft import SFTStage
    return SFTStage


def open_stage(c, run_dir: str, meta=None) -> Stage:
    """The configured stage with its data read and checked; what it made is staged until commit().
    `meta`: the model to be trained (its routers' loss, where it has one, counts the attended
    tokens: the rows then say which they are)."""
    stage = kind(c)
    if c.stage in ("sft", "pt"):
        return stage(c, run_dir, router=meta is not None and router_loss.on(meta))
    from ..data import grid_images
    from ..data.tokens import load_tokenizer
    grid_images.check_template(c, c.tokenizer or c.model)
    tokenizer = load_tokenizer(c.tokenizer or c.model, c.chat_template, c.template, c.model)
    vocab.add(tokenizer, c)
    return stage(c, tokenizer, run_dir)
