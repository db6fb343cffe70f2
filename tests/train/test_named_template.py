"""`template: qwen3`, `qwen3_nothink`, `deepseekr1` and `llama3` write a conversation's tokens as
LlamaFactory's templates of those names do: each turn's slots encoded apart and laid end to end, the answers (with the empty
think block qwen3 adds) the targets. The reference below follows LlamaFactory's encoding step by
step; the tokenizer keeps every run of whitespace as a token, so a newline out of place shows."""
from __future__ import annotations

import json
import os
import re

import pytest

from megacompile.errors import ArgumentError
from megacompile.train.data import named_template, tokens
from tests.train import files

SPECIAL = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
           "</tool_response>"]
WORDS = ["user", "assistant", "system", "be", "brief", "a", "tool"]
SPACES = [" ", "\n", "\n\n"]
EMPTY = "<think>\n\n</think>\n\n"

CHAT = [{"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "i am fine"},
        {"role": "user", "content": "what is the time now"},
        {"role": "assistant", "content": "<think>\nit is late\n</think>\n\nthe time is now"},
        {"role": "user", "content": "thank you"},
        {"role": "assistant", "content": "we like to read"}]

# Qwen3's official template, in short: the think block of an answer before the last question is dropped.
OFFICIAL = ("{%- set ns = namespace(last=-1) -%}{%- for m in messages -%}{%- if m.role == 'user' -%}"
            "{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}{%- for m in messages -%}"
            "{{- '<|im_start|>' + m.role + '\\n' -}}{%- if m.role == 'assistant' and loop.index0 > ns.last -%}"
            "{{- '<think>\\n\\n</think>\\n\\n' + m.content.split('</think>')[-1].lstrip('\\n') -}}"
            "{%- elif m.role == 'assistant' -%}{{- m.content.split('</think>')[-1].lstrip('\\n') -}}"
            "{%- else -%}{{- m.content -}}{%- endif -%}{{- '<|im_end|>\\n' -}}{%- endfor -%}"
            "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


def _tokenizer(template: str = OFFICIAL, special: list[str] = SPECIAL):
    """Words, the specials, and every run of whitespace a token of its own."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = sorted({w for s in files.SENTENCES for w in s.split()} | set(WORDS))
    vocab = {t: i for i, t in enumerate(files.SPECIAL + special + SPACES + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s+"), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": special})
    fast.chat_template = template
    return fast


DEEPSEEK = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]
LLAMA = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<think>", "</think>"]
LAYOUT_TOKENS = {"deepseekr1": DEEPSEEK, "llama3": LLAMA}


def _llamafactory(tok, messages: list, name: str, thinking: bool = True, mask_history: bool = False,
                  preserve: bool = False) -> tuple[list[int], list[int]]:
    """LlamaFactory's encode_multiturn under its template `name`: each message's slots encoded
    apart (deepseekr1's BOS and EOS as token ids); a reasoning template's answer without a think
    block gets the empty one, in the answer (thinking) or at the end of the prompt. `mask_history`
    without `preserve` (its preserve_thinking): discarding_history_cot, the earlier answers' thoughts
    removed and the empty block given to the last answer alone, which alone is a target."""
    def encode(text):
        return tok.encode(text, add_special_tokens=False)
    reasoning = name in ("qwen3", "deepseekr1")
    discard = reasoning and mask_history and not preserve
    system, turns = (messages[0]["content"], messages[1:]) if messages[0]["role"] == "system" else ("", messages)
    thought = re.compile(re.escape("<think>\n") + "(.*?)" + re.escape("\n</think>\n\n"), re.DOTALL)
    turns = [{**m, "content": thought.sub("", m["content"]).lstrip("\n")}
             if m["role"] == "assistant" and reasoning and (not thinking or (discard and k < len(turns) - 1)) else m
             for k, m in enumerate(turns)]
    encoded = []
    for i, m in enumerate(turns):
        if name == "deepseekr1":
            ids = [tok.bos_token_id] + encode(system) if i == 0 else []
            ids += (encode(f"<｜User｜>{m['content']}<｜Assistant｜>") if m["role"] == "user"
                    else encode(m["content"]) + [tok.eos_token_id])
        elif name == "llama3":
            ids = [tok.bos_token_id] if i == 0 else []
            text = f"<|start_header_id|>system<|end_header_id|>\n\n{system}<|eot_id|>" if i == 0 and system else ""
            text += (f"<|start_header_id|>user<|end_header_id|>\n\n{m['content']}<|eot_id|>"
                     "<|start_header_id|>assistant<|end_header_id|>\n\n" if m["role"] == "user"
                     else f"{m['content']}<|eot_id|>")
            ids += encode(text)
        else:
            text = f"<|im_start|>system\n{system}<|im_end|>\n" if i == 0 and system else ""
            text += (f"<|im_start|>user\n{m['content']}<|im_end|>\n<|im_start|>assistant\n" if m["role"] == "user"
                     else f"{m['content']}<|im_end|>\n")
            ids = encode(text)
        encoded.append(ids)
    for i in range(len(turns) - 2 if discard else 0, len(turns), 2):
        if reasoning and "<think>" not in turns[i + 1]["content"] and "</think>" not in turns[i + 1]["content"]:
            if thinking:
                encoded[i + 1] = encode(EMPTY) + encoded[i + 1]
            else:
                encoded[i] = encoded[i] + encode(EMPTY)
    ids, targets = [], []
    for i, part in enumerate(encoded):
        ids += part
        targets += [i % 2 and (not mask_history or i == len(encoded) - 1)] * len(part)
    return ids, targets


@pytest.mark.parametrize("name, thinking", [("qwen3", True), ("qwen3", False), ("qwen3_nothink", True),
                                            ("deepseekr1", True), ("deepseekr1", False), ("llama3", True)])
def test_a_conversation_is_written_as_llamafactory_writes_it(name, thinking):
    tok = named_template.apply(_tokenizer(special=LAYOUT_TOKENS.get(name, SPECIAL)), name)
    options = {} if thinking else {"chat_template_kwargs": {"enable_thinking": False}}
    ids, targets = tokens.encode(tok, {"messages": CHAT, **options}, False, "x:1")
    want_ids, want_targets = _llamafactory(tok, CHAT, name, thinking=thinking)
    assert ids == want_ids
    assert list(map(int, targets)) == want_targets
    assert tok.convert_tokens_to_ids("<unk>") not in ids
    # the answers close with the layout's EOS (<|im_end|> for qwen3's), and nothing follows it
    closed = {"qwen3": ["<|im_end|>", "\n"], "qwen3_nothink": ["<|im_end|>", "\n"], "llama3": ["<|eot_id|>"]}.get(
        name, ["</s>"])
    assert tok.convert_ids_to_tokens(ids[-len(closed):]) == closed and tok.eos_token == closed[0]
    trained = tok.decode([i for i, t in zip(ids, targets) if t])
    first = trained.split(closed[0])[0]
    if name in ("qwen3", "deepseekr1") and thinking:     # an answer's empty block is trained with it
        assert first.replace(" ", "").startswith("<think>\n\n</think>\n\ni")
    else:
        assert "<think>" not in first
    assert ("itislate" in tok.decode(ids).replace(" ", "")) == (name not in ("qwen3", "deepseekr1") or thinking)


@pytest.mark.parametrize("name, thinking, preserve", [("qwen3", True, False), ("qwen3", False, False),
                                                      ("qwen3", True, True), ("deepseekr1", True, False),
                                                      ("deepseekr1", False, True)])
def test_mask_history_drops_the_earlier_answers_thoughts_as_llamafactory_does(name, thinking, preserve):
    """LlamaFactory's mask_history under a reasoning template (without preserve_thinking): the
    earlier answers are written without their think blocks and without the empty one, which the
    last answer alone gets; preserve_thinking writes every answer as without mask_history."""
    tok = named_template.apply(_tokenizer(special=LAYOUT_TOKENS.get(name, SPECIAL)), name)
    options = {**({} if thinking else {"enable_thinking": False}), **({"preserve_thinking": True} if preserve else {})}
    ids, targets = tokens.encode(tok, {"messages": CHAT, "chat_template_kwargs": options}, False, "x:1",
                                 mask_history=True)
    want_ids, want_targets = _llamafactory(tok, CHAT, name, thinking, mask_history=True, preserve=preserve)
    assert ids == want_ids
    assert list(map(int, targets)) == want_targets
    written = tok.decode(ids).replace(" ", "")
    assert ("itislate" in written) == (thinking and preserve)
    assert written.count(EMPTY) == (1 if not preserve else 2 if thinking else 3)


def test_an_alpaca_record_takes_the_chat_template_kwargs_a_chat_takes():
    """enable_thinking (chat_template_kwargs) reaches an Alpaca record's rendering as a chat's."""
    tok = named_template.apply(_tokenizer(), "qwen3")
    quiet = {"chat_template_kwargs": {"enable_thinking": False}}
    alpaca = tokens.encode(tok, {"instruction": "hello there", "output": "i am fine", **quiet}, False, "x:1")
    chat = tokens.encode(tok, {"messages": CHAT[1:3], **quiet}, False, "x:1")
    assert alpaca == chat and EMPTY not in tok.decode([i for i, t in zip(*alpaca) if t]).replace(" ", "")


def test_the_official_template_cannot_be_split_and_the_named_layout_can():
    with pytest.raises(ArgumentError, match="x:1: .* up to turn 2 as a prefix of the whole"):
        tokens.encode(_tokenizer(), {"messages": CHAT}, False, "x:1")
    tok = named_template.apply(_tokenizer(), "qwen3")
    ids, last = tokens.encode(tok, {"messages": CHAT}, False, "x:1", mask_history=True)
    answers = tok.decode([i for i, t in zip(ids, last) if t])
    assert answers.replace(" ", "") == EMPTY + "weliketoread<|im_end|>\n"      # mask_history: the last alone


def test_a_chat_closed_by_the_eos_takes_no_other():
    """ChatML's answers end with <|im_end|> and a newline; where <|im_end|> is the tokenizer's EOS
    (Qwen's), TRL and LlamaFactory add no EOS after the conversation, and a tokenizer whose EOS is
    another token gets it added."""
    chat = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "i am fine"}]
    tok = _tokenizer()
    ids, targets = tokens.encode(tok, {"messages": chat}, False, "x:1")
    assert tok.convert_ids_to_tokens(ids[-3:]) == ["<|im_end|>", "\n", "</s>"] and targets[-1]
    tok.eos_token = "<|im_end|>"
    ids, _ = tokens.encode(tok, {"messages": chat}, False, "x:1")
    assert tok.convert_ids_to_tokens(ids[-2:]) == ["<|im_end|>", "\n"]
    ids, _ = tokens.encode(tok, {"text": "hello there"}, False, "x:2")       # text: the EOS closes it
    assert tok.convert_ids_to_tokens(ids[-1:]) == ["<|im_end|>"]


def test_tools_calls_and_answers_are_written_in_llamafactorys_qwen_format():
    tool = {"type": "function", "function": {"name": "clock", "description": "the time",
                                             "parameters": {"type": "object", "properties": {}}}}
    chat = [{"role": "user", "content": "what is the time now"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "clock", "arguments": {"zone": "utc"}}}]},
            {"role": "tool", "content": "it is late"},
            {"role": "assistant", "content": "the time is now"}]
    tok = named_template.apply(_tokenizer(), "qwen3")
    text = tok.apply_chat_template(chat, tools=[tool], tokenize=False)
    assert text == (
        "<|im_start|>system\n\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(tool, ensure_ascii=False) + "\n</tools>\n\nFor each function call, return a json object with "
        "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
        "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nwhat is the time now<|im_end|>\n"
        "<|im_start|>assistant\n" + EMPTY + "<tool_call>\n{\"name\": \"clock\", \"arguments\": {\"zone\": \"utc\"}}"
        "\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nit is late\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n" + EMPTY + "the time is now<|im_end|>\n")


def test_a_preference_pair_splits_at_the_generation_prompt():
    """Stage dpo's prompt and completions (TRL's tokenisation, posttrain/preference.py) under the
    layout: the prompt ends at the assistant's header, and each completion opens with the empty
    think block it is trained with (LlamaFactory's encode_oneturn with enable_thinking)."""
    from megacompile.posttrain.preference import tokenised
    tok = named_template.apply(_tokenizer(), "qwen3")
    prompt = [{"role": "user", "content": "hello there"}]
    ids, (chosen, rejected) = tokenised(prompt, {"chosen": [{"role": "assistant", "content": "i am fine"}],
                                                 "rejected": [{"role": "assistant", "content": "it is late"}]},
                                        tok, "x:1")
    assert tok.decode(ids).replace(" ", "").endswith("<|im_start|>assistant\n")
    assert tok.decode(chosen).replace(" ", "") == EMPTY + "iamfine<|im_end|>\n"
    _, (quiet,) = tokenised(prompt, {"chosen": [{"role": "assistant", "content": "i am fine"}]}, tok, "x:1",
                            {"enable_thinking": False})
    assert tok.decode(quiet).replace(" ", "") == "iamfine<|im_end|>\n"


def test_a_tokenizer_without_the_layouts_tokens_is_refused():
    plain = _tokenizer(special=[s for s in SPECIAL if s != "<|im_end|>"])
    with pytest.raises(ArgumentError, match="template qwen3: the tokenizer has no <\\|im_end\\|> token, which"):
        named_template.apply(plain, "qwen3")
    with pytest.raises(ArgumentError, match="template deepseekr1: the tokenizer has no <｜User｜> token and no "
                                            "<｜Assistant｜> token"):
        named_template.apply(_tokenizer(), "deepseekr1")


def test_a_run_trains_the_layout_and_writes_the_folders_own_template(tmp_path, capsys):
    """LlamaFactory's run.yaml: `template: qwen3` on a folder whose own template cannot split a
    conversation of three answers; the token file holds the layout's tokens, and the trained model
    keeps the folder's template with <|im_end|> as its EOS, as LlamaFactory writes it."""
    import numpy as np
    from transformers import AutoTokenizer

    from megacompile.train import load, run
    model = files.model_dir(str(tmp_path / "model"), tok=_tokenizer())
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(4)))
    common = dict(model_name_or_path=model, data=str(data), seq=96, batch=2, steps=2, lr=1e-3, log="csv",
                  device="cpu", compute_dtype="float32")
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), run_dir="run", template="qwen3", **common), [])
    assert c.template == "qwen3"
    run(c)
    assert "template 'qwen3': chats are written in LlamaFactory's qwen3 layout" in capsys.readouterr().out
    ids, targets = tokens.encode(named_template.apply(_tokenizer(), "qwen3"), {"messages": CHAT}, False, "x")
    held = tmp_path / "run" / "tokens"
    assert np.fromfile(held / "train.ids", dtype=np.uint32).tolist() == ids * 4
    assert np.fromfile(held / "train.targets", dtype=np.uint8).tolist() == list(map(int, targets)) * 4
    written = AutoTokenizer.from_pretrained(str(tmp_path / "run"))
    assert written.chat_template == OFFICIAL and written.eos_token == "<|im_end|>"
    (tmp_path / "t.jinja").write_text(OFFICIAL)      # a template file given beside it is the one read
    c = load(files.run_yaml(str(tmp_path / "both.yaml"), template="qwen3", chat_template="t.jinja", **common), [])
    assert c.template is None and c.chat_template.endswith("t.jinja")


def test_a_vision_language_model_is_refused_before_anything_is_read(tmp_path):
    from megacompile.train import load, run
    from tests.train import qwen_files, vlm_files
    model = qwen_files.model_dir(str(tmp_path / "vlm"))
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), model=model, template="qwen3", run_dir=str(tmp_path / "run"),
                            data=vlm_files.records(str(tmp_path / "records.jsonl")), steps=1, device="cpu"), [])
    with pytest.raises(ArgumentError, match="template 'qwen3' writes text chats, and .*vlm is a vision-language model"):
        run(c)
    assert not os.path.exists(tmp_path / "run" / "tokens")


@pytest.mark.parametrize("name", sorted(named_template.NAMES))
def test_a_system_message_after_the_first_turn_is_refused_by_every_layout(name):
    """LlamaFactory writes the system message first and nowhere else (its converters refuse a
    system turn later on); a layout of ours writing one mid-conversation would train a layout
    LlamaFactory never makes (deepseekr1 has no system slot but the first: a second user turn)."""
    tok = named_template.apply(_tokenizer(special=LAYOUT_TOKENS.get(name, SPECIAL)), name)
    chat = [{"role": "system", "content": "be brief"}] + CHAT[1:3]
    tokens.encode(tok, {"messages": chat}, False, "x:1")             # first: the system message's place
    with pytest.raises(ArgumentError, match="x:2: .*a system message after the conversation's first turn"):
        tokens.encode(tok, {"messages": chat + [{"role": "system", "content": "be brief"}] + CHAT[3:5]}, False, "x:2")
