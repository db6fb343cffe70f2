"""A tiny Qwen2.5-VL model folder with its processor's files, and PNG images of two sizes, made on
the spot (no downloads): the word-level tokenizer of vlm_files.py with Qwen's vision tokens, a
Qwen2VLImageProcessor (saved from its PIL class) at 4 x 4 pixel patches merged 2 x 2, files.py's
chat template. The model is tests/vlm_families.py's qwen2_5_vl (2 tower layers, one windowed, 4
decoder layers, hidden 32).

Red and green are 16 x 16 pixels (a 4 x 4 grid: 4 image tokens), blue 16 wide and 8 high (2 x 4:
2 tokens); vlm_files.records writes the records that show them."""
from __future__ import annotations

import json
import os

from tests.train import files, vlm_files

VISION = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
SIZES = {"red": (16, 16), "green": (16, 16), "blue": (16, 8)}      # width, height
TOKENS = {"red": 4, "green": 4, "blue": 2}
GRIDS = {"red": (1, 4, 4), "green": (1, 4, 4), "blue": (1, 2, 4)}


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = sorted({w for s in files.SENTENCES for w in s.split()} | set(vlm_files.WORDS))
    vocab = {t: i for i, t in enumerate(files.SPECIAL + VISION + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": VISION})
    return fast


def image_processor():
    from transformers import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                    size={"shortest_edge": 64, "longest_edge": 32 * 32})


def model_dir(path: str, seed: int = 0, family: str = "qwen2_5_vl") -> str:
    """The folder as a Qwen2.5-VL download lays it out: config, weights, tokenizer files,
    preprocessor_config.json naming Qwen2_5_VLProcessor, the chat template. `family` "qwen3_vl": a
    Qwen3-VL (tests/vlm_families.py's, its deepstack after both tower layers) with its processor's
    name; "qwen3_5": a Qwen3.5 with the same processor."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    if family in ("qwen3_vl", "qwen3_5"):
        return _qwen3_vl_dir(path, seed, family)
    tok = tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION}
    torch.manual_seed(seed)
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=256, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, use_cache=False,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=8, out_hidden_size=32, fullatt_block_indexes=[1])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                              video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"], use_cache=False)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(path)
    return _processor_files(path, tok, "Qwen2_5_VLProcessor")


def _qwen3_vl_dir(path: str, seed: int, family: str = "qwen3_vl") -> str:
    """Qwen3-VL, or (family "qwen3_5") Qwen3.5: the same tower without deepstack before a hybrid
    decoder (three gated delta-net layers, one full-attention layer); both use Qwen3VLProcessor."""
    import torch
    import transformers
    tok = tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION}
    torch.manual_seed(seed)
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=128, use_cache=False,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                 "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=16)
    if family == "qwen3_5":
        text.update(num_hidden_layers=4, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                    linear_value_head_dim=8)
        text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[1, 1, 0], partial_rotary_factor=0.5)
    else:
        vision["deepstack_visual_indexes"] = [0, 1]
    name = "Qwen3_5" if family == "qwen3_5" else "Qwen3VL"
    config = getattr(transformers, f"{name}Config")(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"])
    getattr(transformers, f"{name}ForConditionalGeneration")(config).save_pretrained(path)
    return _processor_files(path, tok, "Qwen3VLProcessor")


def _processor_files(path: str, tok, processor: str) -> str:
    tok.save_pretrained(path)
    image_processor().save_pretrained(path)
    where = os.path.join(path, "preprocessor_config.json")
    with open(where) as f:
        saved = json.load(f)
    with open(where, "w") as f:
        json.dump({**saved, "processor_class": processor}, f, indent=2)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(files.TEMPLATE)
    return path


def images(folder: str) -> dict[str, str]:
    """vlm_files.images at this file's SIZES."""
    return vlm_files.images(folder, SIZES)


def records(path: str, n: int = 12, text_every: int = 4) -> str:
    """vlm_files.records' chat records, their images at this file's sizes."""
    vlm_files.records(path, n, text_every)
    images(os.path.dirname(path))
    return path


# LlamaFactory's examples/train_full/qwen2_5vl_full_sft.yaml, its keys and values as written (the model
# and output_dir aside: run.yaml's paths, given by the caller); its `dataset` names are dataset_info.json's
# (llamafactory_data).
LLAMAFACTORY_QWEN2_5VL_FULL_SFT = {
    "image_max_pixels": 262144, "video_max_pixels": 16384, "trust_remote_code": True,
    "stage": "sft", "do_train": True, "finetuning_type": "full", "freeze_vision_tower": True,
    "freeze_multi_modal_projector": True, "freeze_language_model": False,
    "deepspeed": "examples/deepspeed/ds_z3_config.json",
    "dataset": "mllm_demo,identity,alpaca_en_demo", "template": "qwen2_vl", "cutoff_len": 2048,
    "pad_to_multiple_of": 28, "max_samples": 1000, "overwrite_cache": True, "preprocessing_num_workers": 16,
    "dataloader_num_workers": 4,
    "logging_steps": 10, "save_steps": 500, "plot_loss": True, "overwrite_output_dir": True,
    "save_only_model": False, "report_to": "none",
    "per_device_train_batch_size": 1, "gradient_accumulation_steps": 2, "learning_rate": 1.0e-5,
    "num_train_epochs": 3.0, "lr_scheduler_type": "cosine", "warmup_ratio": 0.1, "bf16": True,
    "ddp_timeout": 180000000, "resume_from_checkpoint": None,
}


# examples/train_lora/qwen2_5vl_lora_sft.yaml, the same way.
LLAMAFACTORY_QWEN2_5VL_LORA_SFT = {
    "image_max_pixels": 262144, "video_max_pixels": 16384, "trust_remote_code": True,
    "stage": "sft", "do_train": True, "finetuning_type": "lora", "lora_rank": 8, "lora_target": "all",
    "dataset": "mllm_demo,identity,alpaca_en_demo", "template": "qwen2_vl", "cutoff_len": 2048,
    "max_samples": 1000, "overwrite_cache": True, "preprocessing_num_workers": 16, "dataloader_num_workers": 4,
    "logging_steps": 10, "save_steps": 500, "plot_loss": True, "overwrite_output_dir": True,
    "save_only_model": False, "report_to": "none",
    "per_device_train_batch_size": 1, "gradient_accumulation_steps": 8, "learning_rate": 1.0e-4,
    "num_train_epochs": 3.0, "lr_scheduler_type": "cosine", "warmup_ratio": 0.1, "bf16": True,
    "ddp_timeout": 180000000, "resume_from_checkpoint": None,
}


def llamafactory_data(folder: str, n: int = 6) -> str:
    """LlamaFactory's data folder as its examples name it: dataset_info.json with mllm_demo (ShareGPT
    messages with an `images` column, images under mllm_demo_data/ at SIZES), mllm_video_demo (a
    `videos` column, a clip of video_files.py; every other record has an image too), identity and
    alpaca_en_demo (alpaca records); the folder (run.yaml's dataset_dir, or `data` beside it)."""
    from PIL import Image

    from tests.train import video_files
    os.makedirs(os.path.join(folder, "mllm_demo_data"), exist_ok=True)
    names = sorted(SIZES)
    for name in names:
        Image.new("RGB", SIZES[name], vlm_files.COLOURS[name]).save(os.path.join(folder, "mllm_demo_data",
                                                                                 f"{name}.png"))
    demo = [{"messages": [{"role": "user", "content": "<image>what colour is this"},
                          {"role": "assistant", "content": f"this is {names[i % 3]}"},
                          {"role": "user", "content": "describe this picture"},
                          {"role": "assistant", "content": files.SENTENCES[i % len(files.SENTENCES)]}],
             "images": [f"mllm_demo_data/{names[i % 3]}.png"]} for i in range(n)]
    video_files.clip(os.path.join(folder, "mllm_demo_data", "0.mp4"), frames=6)
    video = [{"messages": [{"role": "user", "content": ("<image>" if i % 2 else "") + "<video>what colour is this"},
                           {"role": "assistant", "content": f"this is {names[i % 3]}"}],
              "videos": ["mllm_demo_data/0.mp4"], **({"images": ["mllm_demo_data/green.png"]} if i % 2 else {})}
             for i in range(n)]
    alpaca = [{"instruction": files.SENTENCES[i % 10], "input": "", "output": files.SENTENCES[(i + 3) % 10]}
              for i in range(n)]
    info = {"mllm_demo": {"file_name": "mllm_demo.json", "formatting": "sharegpt",
                          "columns": {"messages": "messages", "images": "images"},
                          "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                   "assistant_tag": "assistant"}},
            "mllm_video_demo": {"file_name": "mllm_video_demo.json", "formatting": "sharegpt",
                                "columns": {"messages": "messages", "videos": "videos", "images": "images"},
                                "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                         "assistant_tag": "assistant"}},
            "identity": {"file_name": "identity.json"}, "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"}}
    for name, records in (("mllm_demo.json", demo), ("mllm_video_demo.json", video), ("identity.json", alpaca[:2]),
                          ("alpaca_en_demo.json", alpaca)):
        with open(os.path.join(folder, name), "w") as f:
            json.dump(records, f, indent=2)
    with open(os.path.join(folder, "dataset_info.json"), "w") as f:
        json.dump(info, f, indent=2)
    return folder
