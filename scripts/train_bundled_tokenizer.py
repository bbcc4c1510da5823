"""Train the bundled byte-level BPE tokenizer on the bundled corpus and save it as a Hugging Face folder.

Usage: ``python scripts/train_bundled_tokenizer.py`` (about 30 s on two cores). The result is committed under
``hyper_parallel/data/assets/tokenizer``; training is deterministic for a given ``tokenizers`` version.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ASSETS = Path(__file__).resolve().parents[1] / "hyper_parallel/data/assets"
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--output", type=Path, default=ASSETS / "tokenizer")
    args = parser.parse_args()

    with gzip.open(ASSETS / "corpus/austen_chapters.jsonl.gz", "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHATML_TEMPLATE
    wrapped.save_pretrained(args.output)
    print(f"saved a {tokenizer.get_vocab_size()}-token tokenizer to {args.output}")


if __name__ == "__main__":
    main()
