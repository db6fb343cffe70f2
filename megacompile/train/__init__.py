"""Fine-tuning from files: `megacompile train --config run.yaml [key=value ...]` (docs/training.md).

    loop.py      the run, whatever its stage: checks, the stage's data, engine, resume, steps,
                 evaluation, checkpoints, the trained model
    stages/      what is trained step by step: sft (pt too), dpo, kto, grpo (TRL's keys), each a Stage
    data/        records read (JSONL, Parquet, ShareGPT, Alpaca, images), tokenised once into token
                 files (records truncated to a row as LlamaFactory's cutoff_len), masked, held out,
                 mixed, streamed, and packed into rows and micro-batches (a record never split)
    methods/     which parameters train: full, LoRA adapters (PEFT) or some blocks (freeze), a
                 vision-language model's parts frozen, a LoRA run's export
    config.py    run.yaml's keys, defaults and checks (before anything is loaded)
    aliases.py   LlamaFactory's and transformers/TRL's key names read as run.yaml's own
    their_keys.py  their keys not taken here (the equivalent, or why), and where a meaning differs
    their_llamafactory.py  LlamaFactory's keys for what is not done here, with its defaults
    early_stopping.py  early_stopping_patience: the run stops when its evaluations stop improving
    trainer_args.py  a TrainingArguments or TRL config dump's other fields: accepted at their defaults
    schedule.py  learning-rate schedules
    model.py     the model, engine, device budget and the planner's micro-batch choice
    run_plan.py  `megacompile plan --run run.yaml`: the run's model and settings, planned before it
    model_config.py  the run's changes to the folder's config before the model is built, for every build
    router_loss.py  moe_aux_loss_coef: a mixture-of-experts model's load-balancing loss turned on
    rope_scaling.py rope_scaling: the rotary embedding stretched to seq, as LlamaFactory's configure_rope
    vocab.py     add_tokens, add_special_tokens, resize_vocab: tokens added, the model's rows grown
    neftune.py   neftune_noise_alpha: NEFTune's noise on the input embeddings (transformers' hook)
    trained_model.py  where a run leaves its model: export, else the run folder (output_dir)
    best_model.py  load_best_model_at_end: the best checkpoint's weights are the model written
    policy_export.py  a dpo, kto or grpo run's trained policy, an rm run's reward model, as a Hugging Face folder
    checkpoint_export.py  `megacompile export`: a checkpoint of a run written as the run writes its model
    run_args.py  training_args.yaml: the run's settings as given, which export reads the run back from
    results.py   the Trainer's train_results.json, all_results.json, trainer_state.json at the run's end
    loss_plot.py plot_loss: training_loss.png, as LlamaFactory draws it
    log.py       CSV rows per optimizer step, TensorBoard, progress
    wandb_log.py W&B scalars per optimizer step (log: [wandb])
    resume.py    a resume checked against its checkpoint: refused, noted, or already complete
    preemption.py  stop_signals (SIGTERM, SIGUSR1): the step in flight finished, saved, exit 128 + signal
    skip_streak.py max_consecutive_skips: a run whose steps keep being skipped (inf or NaN) stops
    default.yaml the embedded default: the bundled small Llama on the bundled corpus
"""
from .config import RunConfig, load
from .preemption import Preempted, StopSignals
from .loop import run

__all__ = ["Preempted", "RunConfig", "StopSignals", "load", "run"]
