"""Preference records with images, as LlamaFactory's rlhf_v dataset writes them (its sharegpt
ranking layout with an `images` column, named in dataset_info.json), and as TRL's vision
preference records write them ({prompt, chosen, rejected} messages, an image part in the prompt),
for tests/train/qwen_files.py's tiny Qwen2.5-VL: the right colour is chosen, another rejected; and
LlamaFactory's kto_tag layout with images."""
from __future__ import annotations

import json
import os

from tests.train import qwen_files

COLOURS = sorted(qwen_files.SIZES)


def rlhf_v(folder: str, n: int = 8, mixed: bool = True) -> str:
    """dataset_info.json naming `rlhf_v` (ranking, sharegpt, conversations/chosen/rejected/images)
    and its records, images under rlhf_v_data/. `mixed`: every third record is text alone, and the
    images are of two sizes (blue's grid is half red's and green's); else every record shows red or
    green (one shape of micro-batch). The folder."""
    qwen_files.images(os.path.join(folder, "rlhf_v_data"))
    records = []
    for i in range(n):
        colour, wrong = (COLOURS[i % 3], COLOURS[(i + 1) % 3]) if mixed else (("green", "red")[i % 2], "blue")
        shown = i % 3 != 2 or not mixed
        records.append({"conversations": [{"from": "human", "value": ("<image>" if shown else "")
                                           + "what colour is this"}],
                        "chosen": {"from": "gpt", "value": f"this is {colour}"},
                        "rejected": {"from": "gpt", "value": f"this is {wrong} {wrong}"},
                        **({"images": [f"rlhf_v_data/images/{colour}.png"]} if shown else {})})
    with open(os.path.join(folder, "rlhf_v.json"), "w") as f:
        json.dump(records, f, indent=2)
    info = {"rlhf_v": {"file_name": "rlhf_v.json", "ranking": True, "formatting": "sharegpt",
                       "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected",
                                   "images": "images"}}}
    with open(os.path.join(folder, "dataset_info.json"), "w") as f:
        json.dump(info, f, indent=2)
    return folder


def parts_template(path: str) -> str:
    """files.TEMPLATE reading content parts, an image part written as Qwen's templates write it;
    the file's path (run.yaml's chat_template)."""
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    with open(path, "w") as f:
        f.write("{% for m in messages %}<|{{ m['role'] }}|> {% if m['content'] is string %}{{ m['content'] }}"
                "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}" + image
                + "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %} <|end|> {% endfor %}"
                "{% if add_generation_prompt %}<|assistant|> {% endif %}")
    return path


def trl_records(path: str, n: int = 4) -> str:
    """TRL's layout: the prompt a user turn of parts (an image, then text), each answer one
    assistant turn; `images` beside them."""
    qwen_files.images(os.path.dirname(path))
    with open(path, "w") as f:
        for i in range(n):
            colour, wrong = COLOURS[i % 3], COLOURS[(i + 2) % 3]
            f.write(json.dumps({
                "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe this"}]}],
                "chosen": [{"role": "assistant", "content": f"this is {colour}"}],
                "rejected": [{"role": "assistant", "content": f"this is {wrong}"}],
                "images": [f"images/{colour}.png"]}) + "\n")
    return path


def kto_tagged(folder: str, n: int = 6) -> str:
    """dataset_info.json naming `kto_mllm`: LlamaFactory's kto_tag layout (sharegpt messages ending
    with the answer, the kto_tag column renamed to label) with an `images` column; the answer names
    the image's colour (desirable) or another (not), images red or green (one grid). The folder."""
    qwen_files.images(os.path.join(folder, "kto_data"))
    records = []
    for i in range(n):
        colour = ("green", "red")[i % 2]
        right = i % 3 != 1
        records.append({"messages": [{"role": "user", "content": "<image>what colour is this"},
                                     {"role": "assistant", "content": f"this is {colour if right else 'blue'}"}],
                        "label": right, "images": [f"kto_data/images/{colour}.png"]})
    with open(os.path.join(folder, "kto_mllm.json"), "w") as f:
        json.dump(records, f, indent=2)
    info = {"kto_mllm": {"file_name": "kto_mllm.json", "formatting": "sharegpt",
                         "columns": {"messages": "messages", "kto_tag": "label", "images": "images"},
                         "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                  "assistant_tag": "assistant"}}}
    with open(os.path.join(folder, "dataset_info.json"), "w") as f:
        json.dump(info, f, indent=2)
    return folder
