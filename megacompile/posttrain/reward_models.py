"""A reward model as a reward function, as TRL's GRPOTrainer takes one by name: a Hugging Face folder
of a sequence classifier with one label (what `stage: rm` exports), scoring each completion with
its prompt. A prompt given as messages is written through the reward model's own chat template
with the completion as the last assistant message; a text prompt is followed by the completion's
text. The texts are tokenized without added special tokens, padded on the right, and the reward is
the classifier's one logit, as TRL computes it.

The model is read at its first call, not when the run's keys are checked, onto the run's device:
in bfloat16 on cuda, where it sits beside the engine's plans (a run takes it out of its hbm_budget first), and
in float32 on the cpu. It scores `batch` texts at a time."""
from __future__ import annotations

import json
import os

import torch

from ..errors import ArgumentError


def is_reward_model(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


class RewardModelFunction:
    def __init__(self, folder: str, device: str | torch.device = "cpu", batch: int = 16):
        config = _config(folder)
        kinds = config.get("architectures") or []
        labels = config.get("num_labels", len(config.get("id2label") or {}) or 2)
        if not any(k.endswith("ForSequenceClassification") for k in kinds) or labels != 1:
            raise ArgumentError(f"reward model {folder} must be a sequence classifier with one label (what stage rm "
                                f"writes, transformers' ...ForSequenceClassification, num_labels 1); its config.json "
                                f"says architectures {kinds}, num_labels {labels}")
        self.folder, self.device, self.batch = folder, torch.device(device), batch
        self.__name__ = os.path.basename(os.path.normpath(folder))     # the log's rewards/NAME/mean, as TRL's
        self.model = self.tokenizer = None

    def _load(self) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder)
        if self.tokenizer.pad_token is None:            # as TRL pads a reward model's inputs
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(self.folder, dtype=dtype).to(self.device)
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.eval()
        size = sum(p.numel() * p.element_size() for p in self.model.parameters())
        print(f"  note           reward model {self.__name__}: {size / 2**30:.2f} GiB in {str(dtype)[6:]} on "
              f"{self.device}" + (", beside the engine's plans" if self.device.type == "cuda" else ""), flush=True)

    def texts(self, prompts: list, completions: list) -> list[str]:
        out = []
        for prompt, completion in zip(prompts, completions):
            if isinstance(prompt, list):
                if self.tokenizer.chat_template is None:
                    raise ArgumentError(f"reward model {self.folder} scores conversations through its chat template, "
                                        "and its tokenizer has none: give it one (tokenizer_config.json), or give "
                                        "the prompts as text")
                messages = prompt + (completion if isinstance(completion, list) else
                                     [{"role": "assistant", "content": completion}])
                out.append(self.tokenizer.apply_chat_template(messages, tokenize=False))
            else:
                out.append(str(prompt) + str(completion))
        return out

    @torch.inference_mode()
    def __call__(self, prompts, completions, **_) -> list[float]:
        if self.model is None:
            self._load()
        texts = self.texts(list(prompts), list(completions))
        rewards: list[float] = []
        for start in range(0, len(texts), self.batch):
            inputs = self.tokenizer(texts[start:start + self.batch], return_tensors="pt", padding=True,
                                    padding_side="right", add_special_tokens=False).to(self.device)
            rewards += self.model(**inputs).logits[:, 0].float().tolist()
        return rewards


def _config(folder: str) -> dict:
    try:
        with open(os.path.join(folder, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ArgumentError(f"reward model {folder}: cannot read its config.json: {e}") from e
