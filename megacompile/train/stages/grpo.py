"""`stage: grpo`: prompts from records ({prompt, ...}: the prompt as text or messages, the
other columns handed to the reward functions by name, e.g. `answer`; or LlamaFactory's alpaca and
sharegpt records, from data files or dataset_info.json entries: data/prompts.py), completions
sampled from the policy the engine trains (posttrain/rollout.py's EngineGenerator, or the generator run.yaml
chooses: rollouts.py), scored by reward_funcs called as TRL calls them (keywords; for a
prompt given as messages, each completion a list of one assistant message) and summed with
reward_weights, nan-aware (posttrain/rewards.py), and trained by GRPO.

A rollout batch (TRL's generation batch) is batch x steps_per_generation completions,
num_generations of each prompt, in rows of max_prompt_length + max_completion_length tokens (a
longer prompt keeps its last max_prompt_length tokens, as older TRL cut it; TRL 1.16 cuts none, so
the start counts them). What the reward functions log (TRL 1.16's log_metric, log_extra) goes to
the step's metrics and the completions log. It is sampled, scored
and given its advantages whole, then (shuffled, when it is more than one micro-batch, as TRL
shuffles it) cut into steps_per_generation micro-batches of `batch` rows; grad_accum of them make
an optimizer step, and the rollout batch is trained num_iterations times. Every forward takes
`batch` rows, so generation (EngineGenerator), the forward-only passes and the step are each
planned once at a row width; with trim_padding (and retrace) a step's micro-batches, and each
forward-only pass of the old policy and the reference, are cut after their longest completion to
one of four widths (rollout_trim.py), rollouts with images excepted: the loss is that of whole rows. The sampling policy's log-probabilities (old_logps) come from forward-only passes
after the rollout. With loss_type dapo (cispo, vespo) the loss divides by the rollout batch's
completion tokens x grad_accum / steps_per_generation (one accumulation window's share), as TRL's
does (`token_count`). With vLLM, each token is weighed by the sampler's correction
(posttrain/sampling_correction.py). With beta > 0 the
reference is a second engine over the model as it was loaded, forward only (a second copy of the
weights on the host); with sync_ref_model, TRL's reference updates mix the policy into it every
ref_model_sync_steps steps, each update kept in the run folder for a resume
(posttrain/reference_sync.py). A generator that holds a copy of the weights takes the masters before each
rollout that follows a step (`sync()`). A checkpoint falls between rollout batches (stages.py) and
carries the sampler's state beside the prompt position: a resumed run samples the same
completions.

Evaluation (`eval` files or `eval_fraction`, every `eval_every` steps and at the last): one greedy
completion (temperature 0) of each held-out prompt, or with num_generations_eval n, n sampled at the
rollouts' temperature, as TRL evaluates; in calls of `batch` rows (the rollout's row count, so
generation is planned once; the last call filled up with the first prompts, left out), scored by
the same rewards: eval_reward, eval_rewards/NAME/mean, eval_completions/mean_length, and with n:
eval_reward_std, eval_rewards/NAME/std and eval_frac_reward_zero_std (of the groups). Greedy
decoding draws nothing from the sampler; sampling draws from it and puts its state back, so
evaluating leaves the rollouts as they were.

A vision-language model (a folder with its processor) samples prompts with images too, as TRL's
GRPOTrainer reads a vision dataset (data/image_prompts.py): each rollout row holds its prompt's
images, read by the processor when the rows are batched, and every pass over it (each new token's
forward, the old policy's and the reference's log-probabilities, the step, evaluation) sees the
pixels its prompt shows. The engine generator and the hf copies sample them, never drawing an image
token (the copies prefill such prompts whole); vLLM's rollouts of images are not built, and are
refused. Its export gets the processor's files beside it."""
from __future__ import annotations

import base64
import os

import torch

from ...errors import ArgumentError, MegacompileError, NonFiniteError
from ...planner import engine_generator_advice
from ...posttrain import RewardLogs, RewardModelFunction, check_texts, render
from ...posttrain import (IGNORE, EngineGenerator, GRPOLoss, GRPOObjective, TrainerState, decoupled_advantages,
                          decoupled_rewards, grpo_loss, nanstd, rewards, rollout_batch, sampled_logps,
                          sampling_correction, sampling_ratio, truncated)
from . import failed_records, prompt_images, rollouts
from .. import beside, intervals, tokenized
from ..data import grid_images, images, tools, trim, turn_ends
from ..data.image_prompts import image_prompt
from ..data.prompts import file_names, prompt_record
from ..data.reading import records as read_records
from ..data.tokens import fingerprint
from ..log import STEP_COLUMNS
from .completions_log import CompletionsLog
from .rollout_metrics import COMPLETION_METRICS, completion_metrics
from .grpo_keys import epoch_steps, rollout_steps
from .keys import check_resume, check_row_length, saved_keys
from .order import stream_items
from . import reference, rollout_trim
from .stage import Stage


class GRPOStage(Stage):
    check_model = staticmethod(check_row_length)
    check_resume = staticmethod(check_resume)

    def __init__(self, c, tokenizer, run_dir: str | None = None):
        self.c, self.text = c, tokenizer
        # a vision-language model's processor: prompts with images are written through it, and it is
        # what the trained model's folder saves beside it
        self.media = grid_images.for_run(c, tokenizer, c.tokenizer or c.model)
        self.tokenizer = tokenizer if self.media is None else self.media
        if self.media is not None and run_dir is not None:     # images held inside records go there
            self.media.keep_embedded_in(os.path.join(run_dir, "images"))
        self.fingerprint = fingerprint(c.data + c.eval, c.tokenizer or c.model, False, model_dir=c.model)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        # a completion ends at the EOS or at a token the model's generation config stops at (Gemma's
        # <end_of_turn>), as vLLM stops by that config
        self.stops = tuple(sorted(turn_ends.of(tokenizer)))
        device = c.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.funcs = [rewards.load(name, device=device) for name in c.reward_funcs]
        self.names = [getattr(f, "__name__", name) for f, name in zip(self.funcs, c.reward_funcs)]
        if len(set(self.names)) != len(self.names):
            raise ArgumentError(f"reward_funcs {c.reward_funcs}: two functions share a name, and the log keeps each "
                                "function's rewards by name; give each its own")
        # each prompt's record (its columns for the rewards), tokens, images (paths; () for none) and
        # place (data/reading.py's `file:line`), kept beside the record, which the rewards get whole,
        # for a failed step's error to name (failed_records.py)
        self.records, self.prompts, self.shown, self.wheres = [], [], [], []
        self.cut: dict[str, list[int]] = {}     # each file's prompts cut at max_prompt_length, and its prompts
        for entry in c.data:
            self._read(entry, self.records, self.prompts, self.shown, self.wheres)
        self.held_records, self.held_prompts, self.held_shown = [], [], []
        for entry in c.eval:
            self._read(entry, self.held_records, self.held_prompts, self.held_shown, [])
        if c.eval_fraction:
            self._hold_out(c.eval_fraction)
        self.tokenized = tokenized.made({"train": (((p,), w) for p, w in zip(self.prompts, self.wheres)),
                                         "eval": (((p,), None) for p in self.held_prompts)}, "prompt")
        self.with_images = any(self.shown) or any(self.held_shown)
        if self.with_images and c.use_vllm:
            raise ArgumentError("the prompts show images, and vLLM does not sample prompts with images here: leave "
                                "use_vllm out (generator engine, hf or hf_streamed samples them)")
        columns = dict.fromkeys(k for r in self.records + self.held_records for k in r)
        rewards.check_callable(self.funcs, [k for k in columns if k not in ("prompt", "completion", "completion_ids")])
        self.rows = c.batch * c.steps_per_generation       # completions per rollout batch
        self.groups = self.rows // c.num_generations        # prompts per rollout batch
        self.per_rollout = rollout_steps(c)                 # optimizer steps per rollout batch
        self.correct = bool(c.use_vllm and c.vllm_importance_sampling_correction)
        self.token_count = c.loss_type in ("dapo", "cispo", "vespo") and c.steps_per_generation > 1
        self.loss = GRPOLoss(c.epsilon, c.epsilon_high, c.beta, c.loss_type, c.max_completion_length, c.temperature,
                             c.importance_sampling_level, c.delta, c.top_entropy_quantile, c.use_bias_correction_kl,
                             (c.sapo_temperature_pos, c.sapo_temperature_neg),
                             (c.vespo_k_pos, c.vespo_lambda_pos, c.vespo_k_neg, c.vespo_lambda_neg), c.entropy_coef,
                             c.off_policy_mask_threshold)
        # the off-policy mask measures the drift from vLLM's log-probabilities where they are kept
        self.sampler_logps = self.correct and c.off_policy_mask_threshold is not None
        # the clip fraction the loss type has: PPO's clipped surrogate's, CISPO's capped weights', none (SAPO)
        self.clip = {"cispo": ("cispo_clip_ratio",), "sapo": (), "vespo": ("vespo/phi_seq_mean",)}.get(
            c.loss_type, ("clip_ratio",))
        each = tuple(f"rewards/{n}/{s}" for n in self.names for s in ("mean", "std"))
        self.columns = STEP_COLUMNS + (("reward", "reward_std") + each
                        + ("kl",) * (c.beta > 0) + self.clip + COMPLETION_METRICS
                        + sampling_correction.METRICS * self.correct)
        if self.held_prompts:
            self.columns += (("eval_reward",) + tuple(f"eval_rewards/{n}/mean" for n in self.names)
                             + ("eval_completions/mean_length",))
            if c.num_generations_eval is not None:
                self.columns += (("eval_reward_std",) + tuple(f"eval_rewards/{n}/std" for n in self.names)
                                 + ("eval_frac_reward_zero_std",))
        self.generator = self.reference = self.completions = None
        self.needs_reference = c.beta > 0
        self.rollout: dict | None = None
        # rows cut after their longest completion (rollout_trim.py): not under retrace: false, whose one
        # program has one shape
        self.trim = c.trim_padding and c.retrace
        self.epoch = 0.0        # the passes over the prompts the rollouts so far made (TRL's state.epoch)

    def _hold_out(self, fraction: float) -> None:
        """The seeded `fraction` of the prompts, held out for evaluation (as stage: dpo holds pairs)."""
        order = torch.randperm(len(self.prompts), generator=torch.Generator().manual_seed(self.c.seed)).tolist()
        cut = max(1, round(fraction * len(self.prompts)))
        if cut >= len(self.prompts):
            raise ArgumentError(f"eval_fraction {fraction:g} of {len(self.prompts)} prompts leaves none to train "
                                "on; give a smaller fraction, or more prompts")
        held, kept = sorted(order[:cut]), sorted(order[cut:])
        self.held_records, self.held_prompts = [self.records[i] for i in held], [self.prompts[i] for i in held]
        self.held_shown = [self.shown[i] for i in held]
        self.records, self.prompts = [self.records[i] for i in kept], [self.prompts[i] for i in kept]
        self.shown, self.wheres = [self.shown[i] for i in kept], [self.wheres[i] for i in kept]

    def _read(self, entry: dict, records: list, prompts: list, shown: list, wheres: list) -> None:
        names = file_names(entry)
        if self.media is not None:
            self.media.at(entry["path"], entry.get("media_dir"))
        for where, raw in read_records(entry):
            vision = self.media is not None and images.held(raw)
            if not vision:
                images.text_only(raw, where, "grpo")
            record = prompt_record(raw, where, names, vision)
            prompt, media = record["prompt"], ()
            if vision:
                ids, media = image_prompt(raw, prompt, where, self.text, self.media, self.c.max_prompt_length)
            elif isinstance(prompt, list):
                text = render(self.text, prompt, where, "prompt", tokenize=False, add_generation_prompt=True,
                              **tools.template_kwargs(raw, where))
                check_texts(text, prompt, where)
                ids = self.text(text, add_special_tokens=False)["input_ids"]
            else:
                ids = self.text(prompt)["input_ids"]
            if not ids:
                raise ArgumentError(f"{where}: the prompt has no tokens; give it text")
            records.append(record)
            prompts.append(ids[-self.c.max_prompt_length:])
            counted = self.cut.setdefault(entry["path"], [0, 0])
            counted[0] += len(ids) > self.c.max_prompt_length
            counted[1] += 1
            shown.append(media)
            wheres.append(where)
        if not records:
            raise ArgumentError(f"{entry['path']} holds no prompts")

    def describe(self, setup) -> list[str]:
        c = self.c
        held = ""
        if self.held_prompts:
            each = ("one greedy completion" if c.num_generations_eval is None
                    else f"{c.num_generations_eval} sampled completion(s)")
            held = f", {len(self.held_prompts)} held out ({each} of each)"
        held += images.counted(self.shown)
        lines = [f"stage          grpo: {len(self.prompts)} prompts{held}; {self.groups} prompts x {c.num_generations} "
                 f"completions of up to {c.max_completion_length} tokens per rollout batch, in "
                 f"{c.steps_per_generation} micro-batch(es) of {c.batch}, {self.per_rollout} optimizer step(s) each; "
                 f"rewards {', '.join(c.reward_funcs)}; {c.steps} steps"]
        advice = self._generator_advice(setup)
        return lines + self.truncation_lines() + ([f"generator      {advice}"] if advice else [])

    def truncation_lines(self) -> list[str]:
        """What max_prompt_length cut, as stage dpo says its truncation: TRL 1.16 has no such key."""
        cut = {path: n for path, n in self.cut.items() if n[0]}
        if not cut:
            return []
        files = "; ".join(f"{n[0]} of the {n[1]} prompts of {path}" for path, n in cut.items())
        return [f"truncation     {files} cut to their last {self.c.max_prompt_length} tokens (max_prompt_length, "
                "as older TRL's GRPOConfig cut them; TRL 1.16 has no such key and cuts no prompt): raise "
                "max_prompt_length to keep them whole"]

    def _generator_advice(self, setup) -> str | None:
        """With the engine generator: what a copy with a key-value cache would take instead, when the
        plans say it fits and is quicker (planner/posttrain_step.py), from the run's own plans: the
        training step's and the forward-only pass the generator runs once per new token."""
        c = self.c
        # with images a copy would also prefill them whole through the tower, which this advice does not count
        if c.generator != "engine" or c.use_vllm or self.with_images:
            return None
        engine, ids = setup.engine, torch.zeros(c.batch, c.seq, dtype=torch.long)
        train = engine.prepare(**self.first_inputs(setup.batch))      # the run's own, planned already
        # The generator's pass: a call's rows at the run's width, the logits at each row's last token.
        forward = engine.prepare(input_ids=ids, last=torch.zeros(c.batch, dtype=torch.long), train=False)
        keys = {"max_prompt_length": c.max_prompt_length, "max_completion_length": c.max_completion_length,
                "generator": "engine"}
        return engine_generator_advice(engine.model.policy, train, forward, keys, c.batch * c.steps_per_generation,
                                       c.steps_per_generation, engine.budget_bytes)

    def steps_for(self, epochs: float) -> int:
        return epoch_steps(self.c, len(self.prompts), epochs)

    def objective(self, policy):
        return GRPOObjective(policy, self.loss)

    def first_inputs(self, batch: int) -> dict:
        labels = torch.full((batch, self.c.seq), IGNORE, dtype=torch.long)
        labels[:, 0] = 0
        inputs = {"input_ids": torch.zeros(batch, self.c.seq, dtype=torch.long), "labels": labels,
                  "old_logps": torch.zeros(batch, self.c.seq), "advantages": torch.zeros(batch)}
        if self.c.beta > 0:
            inputs["ref_logps"] = torch.zeros(batch, self.c.seq)
        if self.correct:
            inputs["sampling_ratio"] = torch.ones(batch, self.c.seq)
        if self.sampler_logps:
            inputs["sampling_logps"] = torch.zeros(batch, self.c.seq)
        if self.token_count:
            inputs["token_count"] = torch.ones(())
        return self._showing(inputs, [i % len(self.prompts) for i in range(batch)])

    def heaviest_inputs(self, batch: int) -> dict | None:
        """A step's inputs over the `batch` rows whose prompts' images fill the most tokens (None
        without images): the default budget fits their micro-batch too, not only the first one."""
        items = self._heaviest(batch)
        return None if items is None else self._showing(self.first_inputs(batch), items)

    def _heaviest(self, rows: int) -> list[int] | None:
        """`rows` rows at their heaviest, as indices of _pool(): a rollout's rows repeat each prompt
        (num_generations of them, or num_generations_eval held-out), and held-out prompts are
        sampled too, so any of them may fill a micro-batch, a generator call or a rollout."""
        return prompt_images.heaviest_prompts(self.media, self._pool()[1], rows, self._repeats())

    def _repeats(self) -> int:
        """The most rows a prompt fills in one rollout: its completions."""
        return max(self.c.num_generations, self.c.num_generations_eval or 1)

    def _pool(self) -> tuple[list, list]:
        """The prompts and their images, training ones then held-out ones."""
        return self.prompts + self.held_prompts, self.shown + self.held_shown

    def forward_inputs(self, batch: int) -> dict | None:
        """With images, the generator's forward (a next token of each row) over the heaviest prompts,
        whose smallest plan of a vision-language model is larger than its training step's."""
        items = self._heaviest(batch)
        if items is None:
            return None
        rows = self._showing({"input_ids": torch.zeros(batch, self.c.seq, dtype=torch.long)}, items)
        return {**rows, "last": torch.zeros(batch, dtype=torch.long)}

    def _showing(self, rows: dict, items: list[int]) -> dict:
        prompts, shown = self._pool()
        return prompt_images.showing(self.media, rows, [prompts[i] for i in items], [shown[i] for i in items],
                                     self.pad)

    def _rollout_pixels(self) -> tuple[int, int] | None:
        return prompt_images.rollout_pixels(self.media, self._pool()[1], self.rows, self._repeats())

    def _media(self, shown: list[tuple], input_ids: torch.Tensor) -> dict:
        return prompt_images.inputs(self.media, shown, input_ids)

    def device_beside(self, meta, card_bytes: int) -> list:
        """The generator's copy and cache, or colocated vLLM's share, and each reward model's copy and
        what its forward passes through."""
        pixels = self._rollout_pixels()
        return beside.generator_copy(self.c, meta, card_bytes, pixels) + [
            part for f in self.funcs if isinstance(f, RewardModelFunction)
            for part in beside.reward_model(f.folder, rows=f.batch, tokens=self.c.seq)]

    def host_beside(self, meta, device: str) -> list:
        """On the cpu backend the generator's copy and cache and each reward model's float32 copy and
        forward; on a GPU the streamed copy's decoder layers. With images, the pixels every stage
        holds (Stage.host_beside) and a rollout's: the engine generator makes a call's (`batch`
        rows a forward), a copy the whole rollout's, in host memory before they go to the GPU (on
        the cpu backend the copy's are counted with its generate)."""
        models = [] if beside.on_gpu(device) else [
            part for f in self.funcs if isinstance(f, RewardModelFunction)
            for part in beside.reward_model(f.folder, torch.float32, rows=f.batch, tokens=self.c.seq)]
        pixels = self._rollout_pixels()
        return beside.generator_host(self.c, meta, device, pixels) + models + self._pixels_held(device)

    def _pixels_held(self, device: str) -> list:
        if not self.with_images:
            return []
        held = super().host_beside(None, device)
        if self.c.use_vllm:         # refused with images before here
            return held
        if self.c.generator not in ("hf", "hf_streamed"):
            rows, what = self.c.batch, f"a generator call's pixel inputs, at the heaviest {self.c.batch} rows'"
        elif beside.on_gpu(device):
            rows = self.rows
            what = f"a rollout's pixel inputs before they go to the GPU, at the heaviest {rows} rows'"
        else:
            return held
        shown = self._pool()[1]
        return held + beside.pixel_inputs(self._media([shown[i] for i in self._heaviest(rows)], torch.zeros(
            rows, 1, dtype=torch.long)), what)

    def begin(self, engine, run_dir: str, saved: dict | None, batch: int) -> None:
        never = prompt_images.never(self.media) if self.with_images else ()
        self.generator = rollouts.make(self.c, engine, self.stops, self.pad, run_dir, never)
        self.completions = (CompletionsLog(run_dir, engine.steps_done, self.c.num_completions_to_print)
                            if self.c.log_completions else None)
        self.synced = engine.steps_done         # a copy is made from the masters as they are now
        self.run_dir = run_dir
        reference.resume(self.reference, self.c, run_dir, engine.steps_done)
        if saved is not None:
            state = base64.b64decode(saved["sampler"])      # bytes of a tensor of the dtype state() gives
            dtype = self.generator.state().dtype
            self.generator.set_state(torch.frombuffer(bytearray(state), dtype=dtype).clone())

    def _rollout(self, engine, position: int) -> int:
        c, n = self.c, self.c.num_generations
        chosen = stream_items(len(self.prompts), c.seed, position, self.groups, not c.disable_shuffling)
        completions = self._generate(engine, [self.prompts[i] for i in chosen], n, c.temperature,
                                     [self.shown[i] for i in chosen])
        state = TrainerState(engine.steps_done, position / len(self.prompts), c.steps)
        rewards, each, logged = self._score([self.records[i] for i in chosen for _ in range(n)], completions, state,
                                            [self.shown[i] for i in chosen for _ in range(n)])
        masked = truncated(completions, self.stops, self.text.pad_token_id)
        batch = rollout_batch(completions, rewards, n, width=c.seq, pad_id=self.pad, scale=c.scale_rewards,
                              masked=masked if c.mask_truncated_completions else None)
        if c.multi_objective_aggregation == "normalize_then_sum":      # GDPO: each function normalised first
            per_function = torch.stack([each[name] for name in self.names], dim=1)
            batch["advantages"] = decoupled_advantages(per_function, c.reward_weights, n)
            spread = nanstd(decoupled_rewards(per_function, c.reward_weights, n)).expand(len(completions))
        elif c.scale_rewards == "batch":
            spread = nanstd(rewards).expand(len(completions))
        else:
            spread = nanstd(rewards.view(-1, n), dim=1).repeat_interleave(n)
        shown = [self.shown[i] for i in chosen for _ in range(n)]      # each row's images
        # each row's prompt: its place among the prompts the run drew, and its record's
        drawn = [(position + r // n, self.wheres[chosen[r // n]]) for r in range(self.rows)]
        rows = {"input_ids": batch["input_ids"], "labels": batch["labels"],
                "old_logps": self._logps(engine, batch, shown), "advantages": batch["advantages"]}
        if self.reference is not None:
            rows["ref_logps"] = self._logps(self.reference, batch, shown)
        if self.completions is not None:
            texts = [self.text.decode(x.tokens, skip_special_tokens=True) for x in completions]
            self.completions.write(engine.steps_done + 1, [self.records[i]["prompt"] for i in chosen for _ in range(n)],
                                   texts, rewards.tolist(), {k: v.tolist() for k, v in each.items()},
                                   batch["advantages"].tolist(), logged.extra(len(completions)))
        lengths = torch.tensor([float(len(x.tokens)) for x in completions])
        # nan-aware, as TRL logs them: a function's mean over the completions it scored
        metrics = {"reward": torch.nanmean(rewards).item(), "reward_std": nanstd(rewards).item()}
        for name in self.names:
            metrics[f"rewards/{name}/mean"] = torch.nanmean(each[name]).item()
            metrics[f"rewards/{name}/std"] = nanstd(each[name]).item()
        metrics.update(completion_metrics(lengths, torch.tensor(masked), spread))
        metrics.update(logged.metrics(own=self.columns))        # the functions' log_metric, as TRL logs them
        if self.correct:
            sampled = sampled_logps(completions, c.seq)
            if sampled is None:
                raise MegacompileError("vllm_importance_sampling_correction weighs each token by the sampler's "
                                       "log-probability, and vLLM returned none (it needs logprobs=0 in its sampling "
                                       "settings); set vllm_importance_sampling_correction: false to train without it")
            rows["sampling_ratio"], measured = sampling_ratio(rows["old_logps"], sampled,
                                                              batch["labels"] != IGNORE,
                                                              c.vllm_importance_sampling_mode,
                                                              c.vllm_importance_sampling_clip_max,
                                                              c.vllm_importance_sampling_clip_min)
            metrics.update(measured)
            if self.sampler_logps:
                rows["sampling_logps"] = sampled
        if c.steps_per_generation > 1:      # TRL shuffles the generation batch before cutting it
            order = torch.randperm(self.rows, generator=torch.Generator().manual_seed(c.seed + engine.steps_done))
            rows = {k: v[order] for k, v in rows.items()}
            shown, drawn = [shown[i] for i in order.tolist()], [drawn[i] for i in order.tolist()]
        # dapo, cispo, vespo: TRL divides each micro-batch's loss by the rollout batch's completion
        # tokens rescaled to one accumulation window, x grad_accum / steps_per_generation (its logged
        # loss the window's sum of them); the engine divides each micro-batch's gradient by grad_accum
        # and logs their mean, so the loss here divides by the count / steps_per_generation
        count = (batch["labels"] != IGNORE).sum().float() / c.steps_per_generation
        self.rollout = {"rows": rows, "shown": shown, "drawn": drawn, "metrics": metrics,
                        "step": engine.steps_done, "token_count": count}
        self.epoch = (position + self.groups) / len(self.prompts)
        return position + self.groups

    def _logps(self, engine, batch: dict, shown: list[tuple]) -> torch.Tensor:
        """Per-token log-probabilities of the rollout batch under `engine`, in forwards of `batch` rows
        (`shown`: each row's images)."""
        b, ids = self.c.batch, batch["input_ids"]
        return torch.cat([rollout_trim.forward_logps(engine, ids[i:i + b], batch["labels"][i:i + b],
                                                     self._media(shown[i:i + b], ids[i:i + b]), self.trim)
                          for i in range(0, self.rows, b)])

    def _generate(self, engine, prompts: list, n: int, temperature: float, shown: list[tuple]) -> list:
        """n completions of each prompt, `shown[k]` prompt k's images."""
        if engine.steps_done != self.synced and hasattr(self.generator, "sync"):
            self.generator.sync()               # the copy takes the steps since the last rollout
        self.synced = engine.steps_done
        # EngineGenerator's rows at one width, `batch` of them a forward: generation planned once
        shape = ({"width": self.c.seq, "rows_per_call": self.c.batch} if isinstance(self.generator, EngineGenerator)
                 else {})
        if any(shown):      # each call's rows with their prompts' images
            shape["inputs"] = lambda rows, ids: self._media([shown[r // n] for r in rows], ids)
        return self.generator.generate(prompts, n, self.c.max_completion_length, temperature, **shape)

    def _score(self, records: list[dict], completions: list, state: TrainerState,
               shown: list[tuple]) -> tuple[torch.Tensor, dict, RewardLogs]:
        """The rewards of the completions of these records (`shown`: each one's prompt's images,
        handed to the rewards as pictures in the record's image columns, as TRL hands them), and
        what the functions logged (log_metric, log_extra)."""
        records = prompt_images.handed(records, shown)
        texts = [self.text.decode(x.tokens, skip_special_tokens=True) for x in completions]
        # TRL's conversational completions: the assistant's message, for a prompt given as messages
        shown = [[{"role": "assistant", "content": t}] if isinstance(r["prompt"], list) else t
                 for r, t in zip(records, texts)]
        names = [k for k in dict.fromkeys(k for r in records for k in r)
                 if k not in ("prompt", "completion", "completion_ids")]
        columns = {k: [r.get(k) for r in records] for k in names}
        logged = RewardLogs()
        total, each = rewards.score(self.funcs, self.c.reward_weights, [r["prompt"] for r in records], shown,
                                    completion_ids=[list(x.tokens) for x in completions], trainer_state=state,
                                    reward_logs=logged, **columns)
        return total, each, logged

    def step(self, engine, position: int) -> tuple[dict, list, int, int]:
        c = self.c
        k = engine.steps_done % self.per_rollout
        if k == 0:
            position = self._rollout(engine, position)
        elif self.rollout is None:      # stages.py keeps checkpoints between rollout batches
            raise ArgumentError(f"step {engine.steps_done + 1} is inside a rollout batch whose completions are not "
                                f"kept: resume from a checkpoint at a multiple of {self.per_rollout}")
        first = k % (c.steps_per_generation // c.grad_accum) * c.grad_accum
        at = [slice((first + a) * c.batch, (first + a + 1) * c.batch) for a in range(c.grad_accum)]
        parts = [{key: v[cut] for key, v in self.rollout["rows"].items()} for cut in at]
        # the step's micro-batches at one length, their rows' images excepted (rollout_trim.py)
        whole = any(any(self.rollout["shown"][cut]) for cut in at)
        parts = rollout_trim.step_parts(parts, self.trim and not whole)
        if self.token_count:
            for part in parts:
                part["token_count"] = self.rollout["token_count"]
        shown = [self._media(self.rollout["shown"][cut], part["input_ids"]) for part, cut in zip(parts, at)]
        losses, tokens = [], 0
        with trim.own_lengths(self.trim):
            # before the step moves the policy
            measured = [self._measure(engine, part, media) for part, media in zip(parts, shown)]
            try:
                for part, media in zip(parts, shown):   # in first_inputs' order: the inputs of the step planned first
                    losses.append(engine.step(**part, **media))
                    record = engine.last_step
                    # a skipped step's record counts no tokens; the rollout's rows were read all the same
                    tokens += part["input_ids"].numel() if record.tokens is None else record.tokens
                    if record.skipped:
                        break
            except NonFiniteError as e:     # on_nonfinite: raise; the run's error names the prompts' records
                e.records = failed_records.prompts_named(engine, [self.rollout["drawn"][cut] for cut in at])
                raise
        metrics = {**self.rollout["metrics"], **{k: sum(m[k] for m in measured) / len(measured) for k in self.clip}}
        if c.beta > 0:
            metrics["kl"] = sum(m["kl"] for m in measured) / len(measured)
        reference.update(self.reference, engine, c, self.run_dir)
        return metrics, losses, tokens, position

    def _measure(self, engine, part: dict, media: dict) -> dict[str, float]:
        """The clip fraction (and KL) of a micro-batch (`media`: its rows' image inputs) under the
        policy the step starts from: the sampling one (ratio 1) until an optimizer step has moved it."""
        c = self.c
        old = part["old_logps"]
        now = old if engine.steps_done == self.rollout["step"] else torch.as_tensor(
            engine(input_ids=part["input_ids"], labels=part["labels"], **media)).float()
        _, measured = grpo_loss(now, old, part["advantages"], part["labels"] != IGNORE, part.get("ref_logps"),
                                c.epsilon, c.epsilon_high, c.beta, c.loss_type, c.max_completion_length,
                                c.importance_sampling_level, c.delta, sampling_ratio=part.get("sampling_ratio"),
                                bias_correction_kl=c.use_bias_correction_kl, vespo=self.loss.vespo)
        return {k: v.item() for k, v in measured.items()}

    def evaluate(self, engine, step: int) -> dict:
        c = self.c
        if not self.held_prompts or not c.eval_every or not intervals.evaluates(c, step):
            return {}
        count = len(self.held_prompts) if c.eval_batches is None else min(len(self.held_prompts),
                                                                          c.eval_batches * c.batch)
        n = c.num_generations_eval or 1
        per_call = c.batch // n         # prompts a call of batch rows
        sampler = self.generator.state() if c.num_generations_eval else None
        completions = []
        for i in range(0, count, per_call):
            group = [(i + k) % count for k in range(per_call)]
            completions += self._generate(engine, [self.held_prompts[k] for k in group], n,
                                          c.temperature if sampler is not None else 0.0,
                                          [self.held_shown[k] for k in group])[:(count - i) * n]
        if sampler is not None:         # the next rollout draws what it would have drawn without evaluation
            self.generator.set_state(sampler)
        state = TrainerState(engine.steps_done, self.epoch, c.steps)
        rewards, each, logged = self._score([r for r in self.held_records[:count] for _ in range(n)], completions,
                                            state, [s for s in self.held_shown[:count] for _ in range(n)])
        metrics = {"eval_reward": torch.nanmean(rewards).item(),
                   **{f"eval_rewards/{name}/mean": torch.nanmean(each[name]).item() for name in self.names},
                   "eval_completions/mean_length": sum(len(x.tokens) for x in completions) / len(completions)}
        if sampler is not None:
            spread = nanstd(rewards.view(-1, n), dim=1)
            metrics.update({"eval_reward_std": nanstd(rewards).item(),
                            **{f"eval_rewards/{name}/std": nanstd(each[name]).item() for name in self.names},
                            "eval_frac_reward_zero_std":
                                torch.isclose(spread, torch.zeros_like(spread)).float().mean().item()})
        # log_metric's figures as eval_NAME, as TRL names an evaluation's; log_extra's columns go with
        # the rollouts' completions alone
        metrics.update(logged.metrics("eval_", own=self.columns))
        return metrics

    def progress(self, row: dict, budget_bytes: int) -> tuple[str, dict]:
        return f"reward {row['reward']:.4f} | completion length {row['completions/mean_length']:.1f}", {}

    def checkpoint_extra(self) -> dict:
        return {"stage": saved_keys(self.c),
                "sampler": base64.b64encode(self.generator.state().numpy().tobytes()).decode()}

    def close(self) -> None:
        if self.reference is not None:
            self.reference.close()
