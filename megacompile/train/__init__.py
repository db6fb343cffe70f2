"""Fine-tuning from files: `megacompile train --config run.yaml [key=value ...]` (docs/training.md).

    config.py    run.yaml's keys, defaults and checks (before anything is loaded)
    aliases.py   LlamaFactory's and transformers/TRL's key names read as run.yaml's own
    their_keys.py  their keys not taken here (the equivalent, or why), and where a meaning differs
    tokens.py    tokenisation, once, into a memory-mapped token file in the run folder
    sharegpt.py  ShareGPT conversations ({from, value}, human/gpt) read as chat messages
    split.py     eval_fraction: a fraction of the tokens held out
    masking.py   which tokens the loss counts: assistant turns, completions, all of a text
    packing.py   rows (packed, isolated or one document each) and micro-batches
    schedule.py  learning-rate schedules
    model.py     the model, engine, device budget and the planner's micro-batch choice
    finetune.py  which parameters train: full, LoRA adapters (PEFT) or some blocks (freeze)
    vision_freeze.py  a vision-language model's tower, projector or language model frozen
    lora_export.py  a LoRA run's export: the adapter in PEFT's format, or the merged model
    trained_model.py  where a run leaves its model: export, else the run folder (output_dir)
    log.py       CSV rows per optimizer step, TensorBoard, progress
    wandb_log.py W&B scalars per optimizer step (log: [wandb])
    resume.py    a resume checked against its checkpoint: refused, noted, or already complete
    loop.py      the run: steps, eval, checkpoints, resume, the trained model
    stages.py    stage: sft | dpo | grpo, and the post-training keys (TRL's names)
    preemption.py  stop_signals (SIGTERM, SIGUSR1): the step in flight finished, saved, exit 128 + signal
    skip_streak.py max_consecutive_skips: a run whose steps keep being skipped (inf or NaN) stops
    stage_run.py a dpo or grpo run: the loop's order, the stage making each step
    policy_export.py  a dpo or grpo run's trained policy as a Hugging Face model folder
    stage_order.py  the seeded order in which a stage reads its pairs or prompts
    dpo_stage.py, grpo_stage.py  the steps, reference and rollouts, and log columns of each stage
    start.py     the run of the configured stage
    default.yaml the embedded default: the bundled small Llama on the bundled corpus
"""
from .config import RunConfig, load
from .preemption import Preempted, StopSignals
from .start import run

__all__ = ["Preempted", "RunConfig", "StopSignals", "load", "run"]
