"""stage dpo on a vision-language model: preference pairs with images (LlamaFactory's rlhf_v layout,
TRL's vision records) for a tiny Qwen2.5-VL folder (tests/train/qwen_files.py). A pair's rows are
the processor's (each image widened to its grid's tokens in the shared prompt), its micro-batch
carries the images' pixels for the chosen and the rejected rows alike; the objective trains through
the engine as eager torch.optim.AdamW trains it; LlamaFactory's qwen3vl_lora_dpo example runs as
written on each family, its reference log-probabilities are eager transformers' with the pixels,
and its adapter comes out with the processor's files; a run killed mid-way resumes to the
uninterrupted one's log."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from PIL import Image

from megacompile.errors import ArgumentError
from megacompile.posttrain import DPOLoss, DPOObjective
from megacompile.posttrain.logprobs import IGNORE, sequence_logprobs
from megacompile.train import load, log, run
from megacompile.train.data import images
from megacompile.train.data.tokens import load_tokenizer
from megacompile.train.stages import kind
from tests.posttrain import image_pair_files
from tests.posttrain.test_parity import as_eagerly
from tests.train import files, processor_files, qwen_files

GiB = 2 ** 30
PAD, START, END = "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"
# LlamaFactory's examples/train_lora/qwen3vl_lora_dpo.yaml, as written
QWEN3VL_LORA_DPO = {
    "model_name_or_path": "Qwen/Qwen3-VL-4B-Instruct", "image_max_pixels": 262144, "video_max_pixels": 16384,
    "trust_remote_code": True, "stage": "dpo", "do_train": True, "finetuning_type": "lora", "lora_rank": 8,
    "lora_target": "all", "pref_beta": 0.1, "pref_loss": "sigmoid", "dataset": "rlhf_v",
    "template": "qwen3_vl_nothink", "cutoff_len": 2048, "max_samples": 1000, "preprocessing_num_workers": 16,
    "dataloader_num_workers": 4, "output_dir": "saves/qwen3-vl-4b/lora/dpo", "logging_steps": 10, "save_steps": 500,
    "plot_loss": True, "overwrite_output_dir": True, "save_only_model": False, "report_to": "none",
    "per_device_train_batch_size": 1, "gradient_accumulation_steps": 8, "learning_rate": 5.0e-6,
    "num_train_epochs": 3.0, "lr_scheduler_type": "cosine", "warmup_ratio": 0.1, "bf16": True,
    "ddp_timeout": 180000000, "resume_from_checkpoint": None}


def _stage(tmp_path, data: str | None = None, **more):
    """The dpo stage of a run over `data` (else LlamaFactory's rlhf_v entry in tmp_path/data)."""
    model = qwen_files.model_dir(str(tmp_path / "model"))
    named = {"data": data} if data else {"dataset": "rlhf_v", "dataset_dir": str(tmp_path / "data")}
    settings = {"model": model, "stage": "dpo", **named, "batch": 2, "seq": 32, "steps": 3, "device": "cpu",
                "run_dir": str(tmp_path / "run"), **more}
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), **settings), [])
    return kind(c)(c, load_tokenizer(model, c.chat_template), c.run_dir)


def test_a_pair_with_images_is_the_processors_rows_and_its_micro_batch_carries_the_pixels_twice(tmp_path):
    """Each image widens to its grid's tokens inside the prompt both completions share, no image
    token among the completions; a text record is a pair without images; a micro-batch's
    pixel_values and image_grid_thw are the image processor's for the chosen rows' images, then the
    rejected rows', and mm_token_type_ids marks exactly the image tokens; an image rewritten in place
    changes the digest a resumed run's reference is checked against."""
    data = image_pair_files.rlhf_v(str(tmp_path / "data"))
    stage = _stage(tmp_path)
    tok = load_tokenizer(str(tmp_path / "model"), None)
    pad, start, end = (tok.convert_tokens_to_ids(t) for t in (PAD, START, END))
    with open(os.path.join(data, "rlhf_v.json")) as f:
        records = json.load(f)
    assert len(stage.pairs) == len(records)
    for pair, record in zip(stage.pairs, records):
        chosen = record["chosen"]["value"].split()
        assert tok.convert_ids_to_tokens(list(pair.chosen))[:len(chosen)] == chosen
        assert pad not in pair.chosen + pair.rejected
        if "images" not in record:
            assert pair.media == () and pad not in pair.prompt
            continue
        colour = os.path.basename(record["images"][0])[:-4]
        assert pair.media == (os.path.join(data, record["images"][0]),)
        at = [i for i, t in enumerate(pair.prompt) if t == pad]
        assert len(at) == qwen_files.TOKENS[colour] and at == list(range(at[0], at[-1] + 1))
        assert pair.prompt[at[0] - 1] == start and pair.prompt[at[-1] + 1] == end

    shown = [p for p in stage.pairs if p.media]
    group = [shown[0], shown[1]]        # red or green beside blue: two grids
    rows = stage._pack(group)
    written = stage.media.image_processor(images=[Image.open(p.media[0]).convert("RGB") for p in group * 2],
                                          return_tensors="pt")
    assert torch.equal(rows["pixel_values"], written["pixel_values"])
    assert torch.equal(rows["image_grid_thw"], written["image_grid_thw"])
    assert torch.equal(rows["mm_token_type_ids"], (rows["input_ids"] == pad).long())
    for r, pair in enumerate(group * 2):
        completion = pair.chosen if r < 2 else pair.rejected
        assert rows["input_ids"][r, :len(pair.prompt)].tolist() == list(pair.prompt)
        assert rows["labels"][r][rows["labels"][r] != IGNORE].tolist() == list(completion)
    assert set(stage._pack([p for p in stage.pairs if not p.media][:2])) == {"input_ids", "labels"}
    # the reference a resume reads belongs to the images as they were: one rewritten in place is another pair
    from megacompile.train.stages.dpo import pairs_digest
    kept = pairs_digest(stage.pairs)
    Image.new("RGB", Image.open(shown[0].media[0]).size, (1, 2, 3)).save(shown[0].media[0])
    assert pairs_digest(stage.pairs) != kept


def test_trls_vision_records_read_as_llamafactorys_and_the_refusals_name_the_record(tmp_path):
    """TRL's prompt of content parts (an image part, then text) makes the pair the same record in
    LlamaFactory's layout makes, under the run's chat_template, which the processor's files of the
    export carry; a text prompt, or an answer of two turns, with images is refused."""
    trl = image_pair_files.trl_records(str(tmp_path / "trl.jsonl"), 2)
    template = tmp_path / "parts.jinja"     # writes an image part as Qwen's templates do
    image_pair_files.parts_template(str(template))
    stage = _stage(tmp_path, trl, chat_template=str(template))
    with open(trl) as f:
        record = json.loads(f.readline())
    answer = lambda k: {"from": "gpt", "value": record[k][0]["content"]}    # noqa: E731
    sharegpt = {"conversations": [{"from": "human", "value": "<image>describe this"}],
                "chosen": answer("chosen"), "rejected": answer("rejected"), "images": record["images"]}
    path = tmp_path / "sharegpt.jsonl"
    path.write_text(json.dumps(sharegpt) + "\n")
    assert _stage(tmp_path, str(path), chat_template=str(template)).pairs[0] == stage.pairs[0]
    stage.media.save_pretrained(str(tmp_path / "export"))      # the run's template goes with the model it trained
    assert (tmp_path / "export" / "chat_template.jinja").read_text() == template.read_text()
    for bad, words in (({**record, "prompt": "<image> describe this"}, "gives its prompt as a conversation"),
                       ({**record, "chosen": record["chosen"] * 2}, "chosen is the model's one answer")):
        path.write_text(json.dumps(bad) + "\n")
        with pytest.raises(ArgumentError, match=f"sharegpt.jsonl:1: a record with images {words}"
                           if "prompt" in words else f"sharegpt.jsonl:1: with images, {words}"):
            _stage(tmp_path, str(path), chat_template=str(template))


def test_dpo_with_images_trains_through_the_engine_as_eagerly(tmp_path):
    """The stage's micro-batches (pixels of two grids in each) through DPOObjective over the
    Qwen2.5-VL: 3 steps at twice the weights' bytes (as the text objectives' parity runs) give eager
    torch.optim.AdamW's losses and first moments to 1e-5 and its weights to the float32 noise floor,
    and the engine's forward-only log-probabilities are then eager's."""
    image_pair_files.rlhf_v(str(tmp_path / "data"), n=6)
    stage = _stage(tmp_path)
    shown = [p for p in stage.pairs if p.media]
    groups = [[shown[0], shown[1]], [shown[2], shown[3]], [shown[1], shown[0]]]
    from transformers import Qwen2_5_VLForConditionalGeneration
    policy = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path / "model"), dtype=torch.float32)
    policy.train()
    make = lambda: DPOObjective(copy.deepcopy(policy), DPOLoss(beta=0.5))  # noqa: E731
    with torch.no_grad():
        refs = [make()(**stage._pack(g)) for g in groups]
    batches = [{**stage._pack(g), "ref_logps": r} for g, r in zip(groups, refs)]
    weights = sum(p.numel() * 4 for p in policy.parameters())
    engine, reference = as_eagerly(make, batches, 2 * weights / GiB)
    try:
        assert engine.memory_stats()["device_peak_bytes"] == engine.plan.predicted_peak_bytes
        with torch.no_grad():       # the forward-only pass (the reference's, the logged rewards') of the weights now
            for g in groups:
                assert torch.as_tensor(engine(**stage._pack(g))) == pytest.approx(reference(**stage._pack(g)),
                                                                                   rel=1e-5, abs=1e-5)
    finally:
        engine.close()


# each: a tiny model made, one step of two micro-batches and its reference pass (10-20 s on two cores);
# Qwen3-VL (the example's family) in the default tier, LLaVA and Gemma 3 in the slow one, the rest with -m long
@pytest.mark.parametrize("family", ["qwen3_vl", pytest.param("llava", marks=pytest.mark.slow),
                                    pytest.param("gemma3", marks=pytest.mark.slow),
                                    pytest.param("idefics3", marks=pytest.mark.long),
                                    pytest.param("qwen2_5_vl", marks=pytest.mark.long)])
def test_llamafactorys_qwen3vl_lora_dpo_example_trains_and_exports_its_adapter_with_the_processor(tmp_path, family):
    """The example's keys as written (its model and data pointed at a tiny folder of the family and
    an rlhf_v dataset_info.json entry, sizes cut to tiny, float32), no hbm_budget: the run trains;
    its reference log-probabilities are eager transformers' of each pair's rows with the pixels;
    the output folder holds an adapter PEFT loads onto the model and the processor's files."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        processor_files.model_dir("model", family)
        image_pair_files.rlhf_v("data", n=4, mixed=False)
        settings = {**QWEN3VL_LORA_DPO, "model_name_or_path": "model", "max_steps": 2, "logging_steps": 1,
                    "cutoff_len": 128 if family == "idefics3" else 48, "gradient_accumulation_steps": 2,
                    "bf16": False, "learning_rate": 1e-2}
        c = load(files.run_yaml("run.yaml", **settings), ["device=cpu"])
        assert c.hbm_budget is None and c.stage == "dpo"
        assert run(c)["steps"] == 2
        rows = log.read(os.path.join(c.run_dir, "log.csv"))
        assert len(rows) == 2 and float(rows[1]["reward_margin"]) != 0.0
        table = torch.load(os.path.join(c.run_dir, "reference_logps.pt"))["train"]
        stage = kind(c)(c, load_tokenizer("model", None), None)
        assert all(p.media for p in stage.pairs)
        eager = AutoModelForImageTextToText.from_pretrained("model", dtype=torch.float32).eval()
        with torch.no_grad():
            for i, pair in enumerate(stage.pairs):
                rows = stage._pack([pair])
                labels = rows.pop("labels")
                assert "pixel_values" in rows
                both = sequence_logprobs(eager(**rows).logits, labels)
                assert both.tolist() == pytest.approx(table[i].tolist(), rel=1e-5, abs=1e-5)
        assert images.has_processor(c.run_dir) and os.path.isfile(os.path.join(c.run_dir, "tokenizer_config.json"))
        trained = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained("model"), c.run_dir)
        assert any("lora_A" in n for n, _ in trained.named_parameters())
    finally:
        os.chdir(here)


@pytest.mark.slow   # a tiny Qwen2.5-VL trained twice and killed once: about a minute on two cores
def test_a_dpo_run_with_images_killed_mid_way_resumes_to_the_uninterrupted_log(tmp_path):
    """Pairs with images of two sizes beside text pairs, held-out pairs evaluated: killed with
    SIGKILL after step 3 and resumed with `resume: auto` from its step-2 checkpoint, the run writes
    the uninterrupted run's log.csv (losses, rewards, eval figures), its reference read back from the
    run folder."""
    from tests.train import killed
    image_pair_files.rlhf_v(str(tmp_path / "data"), n=9)
    model = qwen_files.model_dir(str(tmp_path / "model"))

    def config(name: str) -> str:
        settings = {"model": model, "stage": "dpo", "dataset": "rlhf_v", "dataset_dir": str(tmp_path / "data"),
                    "batch": 1, "grad_accum": 2, "seq": 48, "steps": 4, "lr": 1e-2, "device": "cpu",
                    "eval_fraction": 0.25, "eval_every": 2, "save_every": 2, "resume": "auto",
                    "run_dir": str(tmp_path / name)}
        return files.run_yaml(str(tmp_path / f"{name}.yaml"), **settings)
    whole = killed.resumes_as_whole(config, tmp_path, steps=4, kill_at=3, kept=["step-000002"])
    assert any(r.get("eval_loss") for r in whole) and len({r["loss"] for r in whole}) > 1
