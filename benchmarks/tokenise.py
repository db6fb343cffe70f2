"""How fast chat records become a token file: records and tokens per second of `token_file`, the
step every supervised run takes before its first step (and a streamed run as it goes).

    python benchmarks/tokenise.py                       # 3,000 three-answer chats
    python benchmarks/tokenise.py --records 20000 --answers 1
    python benchmarks/tokenise.py --workers 1 2 4         # tokenize_workers: one row each

The records are conversations of the bundled corpus's sentences, rendered by a ChatML-style
template and tokenised by a byte-level BPE trained on the same corpus (no downloads). Prints a
table and writes benchmarks/results/tokenise.csv (long format, with the machine and its load
average). No timed asserts: the figures move with the machine's load.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from provenance import machine_facts, write_rows  # noqa: E402

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def sentences() -> list[str]:
    from importlib import resources
    text = resources.files("megacompile.data").joinpath("corpus.txt").read_text()
    return [s.strip() for s in re.split(r"(?<=[.?!])\s+", text) if len(s.split()) > 3]


def tokenizer(lines: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=2000, special_tokens=["<pad>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>")
    fast.chat_template = CHATML
    return fast


def chats(path: str, n: int, answers: int, lines: list[str]) -> None:
    with open(path, "w") as f:
        for i in range(n):
            messages = [{"role": "system", "content": lines[i % len(lines)]}]
            for t in range(answers):
                messages += [{"role": "user", "content": lines[(7 * i + t) % len(lines)]},
                             {"role": "assistant", "content": " ".join(lines[(11 * i + t + k) % len(lines)]
                                                                       for k in range(3))}]
            f.write(json.dumps({"messages": messages}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=3000)
    parser.add_argument("--answers", type=int, default=3, help="assistant turns a conversation holds")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1], help="tokenize_workers to time")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "tokenise.csv"))
    args = parser.parse_args()
    from megacompile.train.data import entries, tokens
    lines = sentences()
    tok = tokenizer(lines)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "chats.jsonl")
        chats(path, args.records, args.answers, lines)
        items = entries.check("data", [path], False, False)
        for repeat in range(args.repeats):       # the worker counts side by side in each repeat
            for workers in args.workers:
                t = time.perf_counter()
                made = tokens.token_file(os.path.join(d, f"tokens{repeat}-{workers}"), "train", items, tok, None,
                                         False, cutoff=8192, workers=workers)
                seconds = time.perf_counter() - t
                rows.append({"records": args.records, "answers": args.answers, "workers": workers,
                             "repeat": repeat, "seconds": seconds, "records_per_s": args.records / seconds,
                             "tokens_per_s": made.ids.size / seconds, "tokens": int(made.ids.size),
                             **machine_facts()})
    print("| records | answers | workers | tokens | median s | records/s | tokens/s | load (1 min) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for workers in args.workers:
        runs = sorted((r for r in rows if r["workers"] == workers), key=lambda r: r["seconds"])
        mid = runs[len(runs) // 2]
        print(f"| {args.records:,} | {args.answers} | {workers} | {mid['tokens']:,} | {mid['seconds']:.2f} | "
              f"{mid['records_per_s']:,.0f} | {mid['tokens_per_s']:,.0f} | {mid['load_average_1min']:.2f} |")
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
