"""stage grpo on a vision-language model: prompts with images, as TRL's GRPOTrainer reads a vision
dataset, for a tiny Qwen2.5-VL folder (tests/train/qwen_files.py). A prompt is the chat template's
with the generation prompt, each image widened to its grid's tokens; the engine generator samples
it with its pixels as transformers' generate does; a step over rollout rows with images trains
through the engine as eager torch.optim.AdamW trains it; a run hands the reward functions the
record's columns, its image's among them, and exports the policy with the processor's files."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from PIL import Image

from megacompile.errors import ArgumentError
from megacompile.posttrain import EngineGenerator, GRPOLoss, GRPOObjective, group_advantages
from megacompile.posttrain.logprobs import IGNORE, token_logprobs
from megacompile.train import load, log, run
from megacompile.train.data.tokens import load_tokenizer
from megacompile.train.stages import kind
from tests.posttrain import image_pair_files
from tests.posttrain.test_parity import as_eagerly
from tests.train import files, processor_files, qwen_files

GiB = 2 ** 30
PAD, START, END, VIDEO = "<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"
COLOURS = ("red", "green", "blue")
CALLS: list[dict] = []      # what names_colour was handed, call by call


def names_colour(prompts, completions, solution, **columns) -> list[float]:
    """1 for a completion that names the prompt's colour (its `solution` column), else 0."""
    CALLS.append({"prompts": prompts, "completions": completions, "solution": solution, **columns})
    said = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(s in t) for s, t in zip(solution, said)]


def brevity(completions, **columns) -> list[float]:
    """Minus each completion's characters over 10: a reward that differs between completions of a
    tiny random model, whose words seldom name a colour."""
    return [-len(c[0]["content"] if isinstance(c, list) else c) / 10 for c in completions]


def trl_prompts(path: str, n: int = 6, text_every: int = 0) -> str:
    """TRL's vision layout: the prompt a user turn of parts (an image, then text), the image in the
    `image` column, the answer in `solution`; every `text_every`-th record a text prompt alone."""
    qwen_files.images(os.path.dirname(path))
    with open(path, "w") as f:
        for i in range(n):
            colour = COLOURS[i % 3]
            if text_every and i % text_every == text_every - 1:
                record = {"prompt": [{"role": "user", "content": "what colour is red"}], "solution": "red"}
            else:
                record = {"prompt": [{"role": "user", "content": [{"type": "image"},
                                                                  {"type": "text", "text": "what colour is this"}]}],
                          "image": f"images/{colour}.png", "solution": colour}
            f.write(json.dumps(record) + "\n")
    return path


def _settings(tmp_path, data: str, **more) -> dict:
    template = image_pair_files.parts_template(str(tmp_path / "parts.jinja"))   # reads an image part
    return {"model": qwen_files.model_dir(str(tmp_path / "model")), "stage": "grpo", "data": data,
            "chat_template": template, "batch": 4, "num_generations": 2, "max_prompt_length": 16,
            "max_completion_length": 4, "reward_funcs": [f"{__name__}:names_colour", f"{__name__}:brevity"],
            "steps": 2, "lr": 1e-2, "device": "cpu", "run_dir": str(tmp_path / "run"), "log_every": 1, **more}


def _stage(tmp_path, data: str, **more):
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), **_settings(tmp_path, data, **more)), [])
    return kind(c)(c, load_tokenizer(c.model, c.chat_template), c.run_dir)


def test_a_prompt_with_images_is_the_templates_with_the_generation_prompt_each_image_widened(tmp_path):
    """TRL's record (an image part, the image in `image`) is the chat template's rendering with the
    generation prompt, its pad token widened to the image's grid's tokens; LlamaFactory's sharegpt
    conversation with an <image> placeholder and TRL's string turn that marks no image (its image
    laid out first) are the same prompt; a text prompt beside them shows none; the record's columns,
    the image's included, are what the reward functions are handed."""
    data = trl_prompts(str(tmp_path / "data" / "prompts.jsonl"), n=4, text_every=4)
    stage = _stage(tmp_path, data)
    tok = stage.text
    pad = tok.convert_tokens_to_ids(PAD)
    for i, colour in enumerate(COLOURS):
        ids = stage.prompts[i]
        written = tok.apply_chat_template([{"role": "user", "content": f"{START}{PAD}{END}what colour is this"}],
                                          tokenize=False, add_generation_prompt=True)
        want = tok(written, add_special_tokens=False)["input_ids"]
        at = want.index(pad)
        assert ids == want[:at] + [pad] * qwen_files.TOKENS[colour] + want[at + 1:]
        assert tok.convert_ids_to_tokens(ids[-1:]) == ["<|assistant|>"]      # the generation prompt
        assert stage.shown[i] == (str(tmp_path / "data" / "images" / f"{colour}.png"),)
        assert stage.records[i] == {"prompt": [{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "what colour is this"}]}],
            "image": f"images/{colour}.png", "solution": colour}
    assert stage.shown[3] == () and pad not in stage.prompts[3]
    same = tmp_path / "data" / "same.jsonl"
    same.write_text(json.dumps({"conversations": [{"from": "human", "value": "<image>what colour is this"}],
                                "images": ["images/red.png"], "solution": "red"}) + "\n"
                    + json.dumps({"prompt": [{"role": "user", "content": "what colour is this"}],
                                  "image": "images/red.png", "solution": "red"}) + "\n")
    other = _stage(tmp_path, str(same))
    assert other.prompts == [stage.prompts[0]] * 2 and other.shown == [stage.shown[0]] * 2


def test_an_images_column_renamed_by_dataset_info_is_handed_to_the_rewards_as_pictures_under_its_name(tmp_path):
    """LlamaFactory's dataset_info.json may name the images column otherwise (`images: pics`): the
    reward functions get that column under the file's name, as they get every column, and as the
    pictures the prompt shows (PIL images, as TRL hands a datasets Image column), not their paths."""
    from megacompile.train.stages import prompt_images
    folder = tmp_path / "data"
    qwen_files.images(str(folder))
    records = [{"conversations": [{"from": "human", "value": "<image>what colour is this"}],
                "pics": [f"images/{colour}.png"], "solution": colour} for colour in COLOURS[:2]]
    (folder / "shown.json").write_text(json.dumps(records))
    (folder / "dataset_info.json").write_text(json.dumps({"shown": {
        "file_name": "shown.json", "formatting": "sharegpt",
        "columns": {"messages": "conversations", "images": "pics"}}}))
    settings = {k: v for k, v in _settings(tmp_path, "").items() if k != "data"}
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), **settings, dataset="shown", dataset_dir=str(folder)), [])
    stage = kind(c)(c, load_tokenizer(c.model, c.chat_template), c.run_dir)
    handed = prompt_images.handed(stage.records, stage.shown)
    for record, colour in zip(handed, COLOURS):
        assert "images" not in record and record["solution"] == colour
        (picture,) = record["pics"]
        with Image.open(folder / "images" / f"{colour}.png") as image:
            assert isinstance(picture, Image.Image) and picture.tobytes() == image.convert(picture.mode).tobytes()
    assert stage.records[0]["pics"] == ["images/red.png"]      # the records themselves keep the paths


@pytest.mark.parametrize("record, more, message", [
    ({"prompt": "<image> what colour is this", "image": "images/red.png"}, {},
     "a prompt with images is a conversation"),
    ({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                              {"type": "text", "text": "what"}]}], "image": "images/red.png"}, {},
     r"the turns hold 2 <image> placeholders \(image parts counted\) and images lists 1 file"),
    ({"prompt": [{"role": "user", "content": "<image>what colour is this"}], "image": "images/red.png"},
     {"max_prompt_length": 8}, "the prompt is 13 tokens with its images, past max_prompt_length 8"),
    ({"prompt": [{"role": "user", "content": "<image>what colour is this"}], "image": "images/red.png"},
     {"use_vllm": True}, "the prompts show images, and vLLM does not sample prompts with images here"),
    ({"prompt": [{"role": "user", "content": "<image>what"}], "image": "images/mauve.png"}, {},
     "image images/mauve.png is not there"),
])
def test_a_prompt_with_images_that_cannot_train_is_refused_naming_the_record_and_the_fix(tmp_path, monkeypatch,
                                                                                          record, more, message):
    import sys
    from tests.posttrain import fake_vllm
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm.module())      # a stand-in: vLLM needs a GPU
    path = tmp_path / "data" / "bad.jsonl"
    qwen_files.images(str(path.parent))
    path.write_text(json.dumps({**record, "solution": "red"}) + "\n")
    with pytest.raises(ArgumentError, match=message):
        _stage(tmp_path, str(path), **more)


def _policy(tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path / "model"), dtype=torch.float32)


def test_each_generator_samples_a_prompt_with_images_as_transformers_generate(tmp_path):
    """Greedy completions of prompts with images of two sizes (and a text prompt) are transformers'
    generate's on each prompt alone with its pixels, the image and video tokens suppressed as the
    generators never draw them: the engine generator's, two rows a call, and the hf copies' (whole
    and streamed, the prompts left-padded together, in float32)."""
    from megacompile import compile
    from megacompile.posttrain import HFGenerator, StreamedHFGenerator
    stage = _stage(tmp_path, trl_prompts(str(tmp_path / "data" / "prompts.jsonl"), n=4, text_every=4))
    policy = _policy(tmp_path).eval()
    tok = stage.text
    never = [tok.convert_tokens_to_ids(t) for t in (PAD, VIDEO)]
    engine = compile(GRPOObjective(copy.deepcopy(policy)), hbm_budget=1, device="cpu", compute_dtype=torch.float32)
    try:
        generator = EngineGenerator(engine, eos_id=tok.eos_token_id, pad_id=stage.pad, never=tuple(never))
        order = [2, 0, 3, 1]        # blue beside red, the text prompt beside green
        inputs = lambda rows, ids: stage._media([stage.shown[order[r]] for r in rows], ids)  # noqa: E731
        made = {"engine": generator.generate([stage.prompts[i] for i in order], 1, 4, 0.0, width=24, rows_per_call=2,
                                             inputs=inputs)}
        for made_by in (HFGenerator, StreamedHFGenerator):
            held = made_by(engine, eos_id=tok.eos_token_id, pad_id=stage.pad, dtype=torch.float32, never=tuple(never))
            made[made_by.__name__] = held.generate([stage.prompts[i] for i in order], 1, 4, 0.0, inputs=inputs)
    finally:
        engine.close()
    for k, i in enumerate(order):
        ids = torch.tensor([stage.prompts[i]])
        want = policy.generate(input_ids=ids, **stage._media([stage.shown[i]], ids), max_new_tokens=4,
                               do_sample=False, suppress_tokens=never, eos_token_id=tok.eos_token_id)
        for name, completions in made.items():
            assert list(completions[k].tokens) == want[0, ids.shape[1]:].tolist(), name


# each: a tiny model made and 4 tokens of 2 prompts sampled both ways, 1-3 s on two cores
@pytest.mark.parametrize("family", ["llava", "gemma3", "qwen3_vl", "idefics3"])
def test_each_familys_prompts_with_images_sample_as_transformers_generate(tmp_path, family):
    """A prompt with an <image> placeholder is what the family's processor writes of the template's
    rendering with the generation prompt, and the engine generator's greedy completions of two
    prompts with images of two sizes are transformers' generate's, the image tokens suppressed."""
    from transformers import AutoModelForImageTextToText

    from megacompile import compile
    model = processor_files.model_dir(str(tmp_path / "model"), family)
    path = tmp_path / "data" / "prompts.jsonl"
    processor_files.images(str(path.parent))
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": "<image>what colour is this"}],
                                        "image": f"images/{colour}.png", "solution": colour}) + "\n"
                            for colour in ("red", "blue")))
    width = 160 if family == "idefics3" else 48
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), model=model, stage="grpo", data=str(path), batch=2,
                            num_generations=2, max_prompt_length=width - 4, max_completion_length=4,
                            reward_funcs=[f"{__name__}:names_colour"], steps=1, device="cpu",
                            run_dir=str(tmp_path / "run")), [])
    stage = kind(c)(c, load_tokenizer(model, None), c.run_dir)
    # Qwen's processor is taken apart (it needs torchvision whole): the first test holds its prompts
    processor = getattr(stage.media, "processor", None)
    if processor is not None:
        from PIL import Image
        # the tiny folders' template writes a turn's text as it is: the image as the processor's token in it
        text = processor.apply_chat_template([{"role": "user",
                                               "content": f"{stage.media.written}what colour is this"}],
                                             add_generation_prompt=True)
        for ids, shown in zip(stage.prompts, stage.shown):
            written = processor(text=[text], images=[[Image.open(shown[0]).convert("RGB")]], add_special_tokens=False)
            assert ids == written["input_ids"][0]
    policy = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()
    never = tuple(stage.media.image_ids)
    engine = compile(GRPOObjective(copy.deepcopy(policy)), hbm_budget=1, device="cpu", compute_dtype=torch.float32)
    try:
        generator = EngineGenerator(engine, eos_id=stage.text.eos_token_id, pad_id=stage.pad, never=never)
        made = generator.generate(stage.prompts, 1, 4, 0.0, width=width, rows_per_call=2,
                                  inputs=lambda rows, ids: stage._media([stage.shown[r] for r in rows], ids))
    finally:
        engine.close()
    for ids, shown, completion in zip(stage.prompts, stage.shown, made):
        ids = torch.tensor([ids])
        want = policy.generate(input_ids=ids, **stage._media([shown], ids), max_new_tokens=4, do_sample=False,
                               suppress_tokens=list(never), eos_token_id=stage.text.eos_token_id)
        assert list(completion.tokens) == want[0, ids.shape[1]:].tolist()


def _rollout_rows(stage, items: list[int], step: int) -> dict:
    """Rows of these prompts (with their images) and completions of random words, as a rollout
    batch lays them out: labels on the completions (shifted), two completions per prompt."""
    g = torch.Generator().manual_seed(step)
    words = [t for t in range(len(stage.text)) if t not in (stage.text.convert_tokens_to_ids(PAD), stage.pad)]
    seq = stage.c.seq
    ids = torch.full((len(items), seq), stage.pad, dtype=torch.long)
    labels = torch.full((len(items), seq), IGNORE, dtype=torch.long)
    for r, i in enumerate(items):
        prompt = stage.prompts[i]
        completion = [words[k] for k in torch.randint(0, len(words), (2 + r % 3,), generator=g)]
        row = prompt + completion
        ids[r, :len(row)] = torch.tensor(row)
        labels[r, len(prompt) - 1:len(row) - 1] = torch.tensor(completion)
    return {"input_ids": ids, "labels": labels, **stage._media([stage.shown[i] for i in items], ids)}


def test_a_grpo_step_over_rows_with_images_trains_through_the_engine_as_eagerly(tmp_path):
    """Three steps over rollout rows of two grids (and a text row): GRPOObjective over the
    Qwen2.5-VL through the engine at twice the weights' bytes gives eager torch.optim.AdamW's
    losses and first moments to 1e-5 and its weights to the float32 noise floor; the engine's
    forward-only log-probabilities (the old policy's, the reference's) and next-token logits (the
    generator's) are then eager's."""
    stage = _stage(tmp_path, trl_prompts(str(tmp_path / "data" / "prompts.jsonl"), n=4, text_every=4))
    policy = _policy(tmp_path)
    policy.train()
    make = lambda: GRPOObjective(copy.deepcopy(policy), GRPOLoss(beta=0.04, epsilon_high=0.28))  # noqa: E731
    groups = [[0, 0, 2, 2], [1, 1, 3, 3], [2, 2, 0, 0]]
    batches = []
    for step, items in enumerate(groups):
        rows = _rollout_rows(stage, items, step)
        media = {k: v for k, v in rows.items() if k not in ("input_ids", "labels")}
        with torch.no_grad():
            old, _ = token_logprobs(policy(rows["input_ids"], **media).logits, rows["labels"])
        rewards = torch.tensor([1.0, 0.0, 0.5, 1.0]) + step
        batches.append({"input_ids": rows["input_ids"], "labels": rows["labels"], "old_logps": old + 0.05,
                        "advantages": group_advantages(rewards, 2), "ref_logps": old, **media})
    weights = sum(p.numel() * 4 for p in policy.parameters())
    engine, reference = as_eagerly(make, batches, 2 * weights / GiB)
    try:
        with torch.no_grad():
            for items in groups:
                rows = _rollout_rows(stage, items, 7)
                assert torch.as_tensor(engine(**rows)) == pytest.approx(reference(**rows), rel=1e-5, abs=1e-5)
                last = (rows["labels"] != IGNORE).sum(-1) + torch.tensor([len(stage.prompts[i]) for i in items]) - 1
                media = {k: v for k, v in rows.items() if k != "labels"}
                assert torch.as_tensor(engine(**media, last=last)) == pytest.approx(reference(**media, last=last),
                                                                                    rel=1e-5, abs=1e-5)
    finally:
        engine.close()


# TRL's docs' GRPO of a vision-language model, its keys as its GRPOConfig writes them (the model and
# data pointed at tiny local ones, sizes cut to tiny, float32)
TRL_VLM_GRPO = {"per_device_train_batch_size": 4, "num_generations": 2, "max_prompt_length": None,
                "max_completion_length": 4, "learning_rate": 1e-2, "max_steps": 2, "logging_steps": 1,
                "log_completions": True, "bf16": False, "gradient_checkpointing": True, "report_to": "none",
                "remove_unused_columns": False}


# the engine generator in the default tier; the hf copy (its bound counted beside the engine) in the slow one
@pytest.mark.parametrize("generator", ["engine", pytest.param("hf", marks=pytest.mark.slow)])
def test_a_trl_grpo_run_over_prompts_with_images_hands_the_rewards_their_columns_and_exports_the_processor(
        tmp_path, capsys, generator):
    """TRL's keys over TRL's vision records (and a text prompt among them), a fifth held out: the
    run trains 2 steps; each reward call gets every completion beside its prompt's `image` (the
    picture, as TRL hands a datasets Image column on) and `solution`; no completion holds an image
    token; held-out prompts are evaluated with their images; the output folder holds the trained
    policy, which transformers loads, and the processor's files. With the hf copy, what its generate
    passes through counts the tower's pass over the rollout's images."""
    from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration
    CALLS.clear()
    data = trl_prompts(str(tmp_path / "data" / "prompts.jsonl"), n=10, text_every=5)
    settings = {k: v for k, v in _settings(tmp_path, data).items()
                if k not in ("batch", "num_generations", "max_prompt_length", "max_completion_length", "steps",
                             "lr", "log_every")}
    settings = {**settings, **TRL_VLM_GRPO, "max_prompt_length": 16, "eval_fraction": 0.2, "eval_every": 2,
                **({"generator": generator} if generator != "engine" else {})}
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), **settings), [])
    assert run(c)["steps"] == 2
    if generator == "hf":
        assert "a prefill of 4 x 16 tokens, the vision tower's pass over their images" in capsys.readouterr().out
    rows = log.read(str(tmp_path / "run" / "log.csv"))
    assert len(rows) == 2 and rows[1]["eval_reward"] != ""
    tok = load_tokenizer(c.model, c.chat_template)
    banned = {tok.convert_tokens_to_ids(t) for t in (PAD, VIDEO)}
    with open(data) as f:
        records = [json.loads(line) for line in f]
    for call in CALLS[:2]:      # the rollouts' (the third is the evaluation's)
        assert len(call["completions"]) == 4 and call["prompts"][0::2] == call["prompts"][1::2]
        for prompt, image, solution in zip(call["prompts"], call["image"], call["solution"]):
            record = next(r for r in records if r["prompt"] == prompt and r["solution"] == solution)
            if "image" not in record:       # a text prompt: no picture
                assert image is None
                continue
            with Image.open(tmp_path / "data" / record["image"]) as shown:     # TRL's: the picture itself
                assert isinstance(image, Image.Image) and image.size == shown.size
                assert image.convert("RGB").tobytes() == shown.convert("RGB").tobytes()
        for completion in call["completions"]:
            assert not banned & set(tok(completion[0]["content"], add_special_tokens=False)["input_ids"])
    assert len(CALLS) == 3 and len(CALLS[2]["completions"]) == 2      # the two held-out prompts, greedily
    assert os.path.isfile(tmp_path / "run" / "preprocessor_config.json")
    assert AutoImageProcessor.from_pretrained(str(tmp_path / "run")).merge_size == 2
    trained = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path / "run"))
    before = _policy(tmp_path).state_dict()
    assert any(not torch.equal(v, before[k]) for k, v in trained.state_dict().items())


@pytest.mark.slow   # a tiny Qwen2.5-VL's grpo run twice and a killed one: about a minute on two cores
def test_a_grpo_run_over_prompts_with_images_killed_mid_way_resumes_to_the_uninterrupted_log(tmp_path):
    """Rollout batches of two micro-batches (two optimizer steps) over prompts with images of two sizes
    (a text prompt among them), a KL term: killed with SIGKILL after step 3 and resumed with `resume:
    auto` from its step-2 checkpoint, the run writes the uninterrupted run's log.csv, rewards and KL
    included (the rollout sampled again with each row's pixels, the shuffle moving the images with
    their rows)."""
    from tests.train import killed
    data = trl_prompts(str(tmp_path / "data" / "prompts.jsonl"), n=8, text_every=4)

    def config(name: str) -> str:
        settings = _settings(tmp_path, data, batch=2, steps_per_generation=2, steps=4, beta=0.05,
                             save_every=2, resume="auto", run_dir=str(tmp_path / name))
        return files.run_yaml(str(tmp_path / f"{name}.yaml"), **settings)
    whole = killed.resumes_as_whole(config, tmp_path, steps=4, kill_at=3, kept=["step-000002"])
    assert len({r["reward"] for r in whole}) > 1 and any(float(r["kl"]) > 0 for r in whole)


def _videos_sample_as_transformers_generate(folder: str) -> None:
    """In a process where torchvision imports (the video processor needs it): grpo prompts with a
    video (LlamaFactory's conversations and `videos` column) beside one with an image, the engine
    generator's greedy completions, two rows a call, are transformers' generate's on each prompt
    alone with its pixels (pixel_values_videos, video_grid_thw, second_per_grid_ts), image and
    video tokens suppressed; a 1-step run over them logs a finite loss."""
    import math

    from megacompile import compile
    from tests.train import video_files
    tmp = __import__("pathlib").Path(folder)
    video_files.model_dir(str(tmp / "model"), "qwen2_5_vl")
    video_files.clip(str(tmp / "data" / "clips" / "a.mp4"))
    qwen_files.images(str(tmp / "data"))
    with open(tmp / "data" / "prompts.jsonl", "w") as f:
        for shown in ({"videos": ["clips/a.mp4"]}, {"images": ["images/blue.png"]}, {"videos": ["clips/a.mp4"]}):
            mark = "<video>" if "videos" in shown else "<image>"
            f.write(json.dumps({"conversations": [{"from": "human", "value": f"{mark} what colour is this"}],
                                **shown, "solution": "red"}) + "\n")
    c = load(files.run_yaml(str(tmp / "run.yaml"), **_settings(tmp, str(tmp / "data" / "prompts.jsonl"),
                                                               max_prompt_length=64, steps=1)), [])
    stage = kind(c)(c, load_tokenizer(c.model, c.chat_template), c.run_dir)
    assert [len(s) for s in stage.shown] == [1, 1, 1] and "a.mp4" in str(stage.shown[0][0])
    tok = stage.text
    video = tok.convert_tokens_to_ids(VIDEO)
    assert video in stage.prompts[0] and video not in stage.prompts[1]
    never = [tok.convert_tokens_to_ids(t) for t in (PAD, VIDEO)]
    policy = _policy(tmp).eval()
    engine = compile(GRPOObjective(copy.deepcopy(policy)), hbm_budget=1, device="cpu", compute_dtype=torch.float32)
    order = [0, 1, 2, 1]
    try:
        generator = EngineGenerator(engine, eos_id=tok.eos_token_id, pad_id=stage.pad, never=tuple(never))
        inputs = lambda rows, ids: stage._media([stage.shown[order[r]] for r in rows], ids)  # noqa: E731
        made = generator.generate([stage.prompts[i] for i in order], 1, 4, 0.0, width=64, rows_per_call=2,
                                  inputs=inputs)
    finally:
        engine.close()
    for k, i in enumerate(order):
        ids = torch.tensor([stage.prompts[i]])
        given = stage._media([stage.shown[i]], ids)
        assert ("pixel_values_videos" in given) == (i != 1)
        want = policy.generate(input_ids=ids, **given, max_new_tokens=4, do_sample=False, suppress_tokens=never,
                               eos_token_id=tok.eos_token_id)
        assert list(made[k].tokens) == want[0, ids.shape[1]:].tolist(), i
    rows = log.read(os.path.join(c.run_dir, "log.csv")) if run(c)["steps"] == 1 else []
    assert len(rows) == 1 and math.isfinite(float(rows[0]["loss"]))


@pytest.mark.slow      # a child process where torchvision imports, two generations and a run: ~45 s
def test_prompts_with_videos_sample_as_transformers_generate_and_train(tmp_path):
    from tests import torchvision_env
    torchvision_env.call(_videos_sample_as_transformers_generate, str(tmp_path))


def test_the_heaviest_rows_repeat_a_prompt_as_its_completions_do(tmp_path):
    """A rollout's rows hold each prompt's num_generations completions, so its heaviest micro-batch,
    generator call or rollout is the heaviest prompts' rows, each repeated: the default budget and
    the host's pixel figures are sized on them (a held-out prompt among them), not on as many
    distinct prompts."""
    from megacompile.train.data.image_answers import heaviest

    class Widths:
        def width(self, path, where):
            return {"big": 10, "mid": 9, "small": 1}[path]
    shown = [("small",), ("big",), ("mid",), ()]
    assert heaviest(shown, Widths(), 4) == [0, 1, 2, 3] and heaviest(shown, Widths(), 3) == [0, 1, 2]
    assert heaviest(shown, Widths(), 4, each=2) == [1, 1, 2, 2]
    assert heaviest(shown, Widths(), 3, each=4) == [1, 1, 1]
    data = trl_prompts(str(tmp_path / "data" / "prompts.jsonl"), n=4, text_every=4)     # red, green, blue, text
    stage = _stage(tmp_path, data, batch=4, num_generations=2, eval_fraction=0.25, seed=1)
    assert len(stage.held_prompts) == 1
    grids = {tuple(g) for g in stage.heaviest_inputs(4)["image_grid_thw"].tolist()}
    assert grids == {qwen_files.GRIDS["red"]}          # red's and green's rows, twice each: no blue


def test_a_stage_says_how_many_of_its_records_show_images_or_videos():
    from megacompile.train.data.images import counted
    assert counted([(), ()]) == ""
    assert counted([("a.png",), (), ("b.png", "c.png")]) == ", 2 with images"
    assert counted([({"video": "a.mp4"},), ()]) == ", 1 with videos"
    assert counted([("a.png",), ({"video": "a.mp4"},)]) == ", 2 with images or videos"
