"""Specification of the tokenizer objects the pipeline takes: the library's ``TextTokenizer``, ``transformers``
objects (``AutoTokenizer``'s ``TokenizersBackend``, ``PreTrainedTokenizerFast``) and tiktoken-format tokenizers.

Every kind gives the same ids as the bundled tokenizer through the transforms, the Online and Indexed datasets,
the collator, a whole pipeline and offline preparation, with its own special tokens and chat template. The
tiktoken tokenizer is the bundled byte-level BPE vocabulary written in tiktoken's format; the ``tiktoken``
package itself is the reference for its ids.
"""

from __future__ import annotations

import base64
import gzip
import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import tiktoken
from indexed.test_index_cache import assert_same_datasets, write_corpus
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hyper_parallel.data.batching.build_collate_fn import build_online_text_collate_fn
from hyper_parallel.data.batching.dataloader import build_dataloaders
from hyper_parallel.data.constants import IGNORE_INDEX
from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.indexed.indexed_data_reader import IndexedDataReader
from hyper_parallel.data.text.build_data_transform import TextConversationTransform, build_llm_data_transform
from hyper_parallel.data.text.build_dataset import build_indexed_text_dataset, build_online_text_dataset
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH, TextTokenizer, build_tokenizer
from hyper_parallel.data.text.chat_template import ChatMLTemplate
from hyper_parallel.data.tokenizer_protocol import read_tokenizer
from hyper_parallel.data.tools.offline_config import OfflinePreparationConfig
from hyper_parallel.data.tools.offline_preparation import run_offline_preparation

# The bundled tokenizer's ByteLevel pre-tokenizer splits text with GPT-2's expression (tiktoken's "gpt2"/"r50k").
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Llama 3's expression.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# Qwen's expression: digits one by one.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
BUNDLED_SPECIALS = {"<|endoftext|>": 0, "<|pad|>": 1, "<|im_start|>": 2, "<|im_end|>": 3}
EOS, PAD = 0, 1
TEXTS = [
    "The family of Dashwood had long been settled in Sussex.",
    "naïve café — 日本語, 1811! It's 12345678 o'clock;\n\n  spaces   and\ttabs\r\n",
    "<|im_start|>user\nHello<|im_end|>\n<|endoftext|>",
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Who settled in Sussex?"},
    {"role": "assistant", "content": "The family of Dashwood, in 1811."},
]
# The chat template of the PreTrainedTokenizerFast kind: not the bundled one, and it reads eos_token.
OWN_TEMPLATE = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + eos_token + '\n' }}{% endfor %}"
KINDS = ["library", "auto", "fast", "tiktoken"]


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level BPE writes -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


def bundled_ranks() -> dict[bytes, int]:
    """The bundled tokenizer's mergeable tokens as bytes -> id (its special tokens, ids 0-3, left out)."""
    vocab = json.loads((BUNDLED_TOKENIZER_PATH / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
    decoder = byte_decoder()
    return {bytes(decoder[c] for c in token): i for token, i in vocab.items() if token not in BUNDLED_SPECIALS}


def write_tiktoken(path: Path, ranks: dict[bytes, int]) -> Path:
    lines = (
        f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in sorted(ranks.items(), key=lambda x: x[1])
    )
    path.write_text("".join(lines), encoding="ascii")
    return path


def corpus_texts(count: int = 3, chars: int = 4000) -> list[str]:
    """The first chapters of the bundled corpus, cut to ``chars`` characters."""
    path = BUNDLED_TOKENIZER_PATH.parent / "corpus" / "austen_chapters.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        return [json.loads(next(lines))["text"][:chars] for _ in range(count)]


@pytest.fixture(scope="module")
def reference() -> Tokenizer:
    """The bundled tokenizer.json read by ``tokenizers`` alone: the ids every kind must give."""
    return Tokenizer.from_file(str(BUNDLED_TOKENIZER_PATH / "tokenizer.json"))


@pytest.fixture(scope="module")
def tiktoken_dir(tmp_path_factory) -> Path:
    """A tiktoken tokenizer directory as Kimi's or Llama 3's: the vocabulary, and a tokenizer_config.json that
    names the special tokens (with their ids) and the EOS and pad, and the bundled chat template."""
    directory = tmp_path_factory.mktemp("tiktoken")
    write_tiktoken(directory / "bundled.tiktoken", bundled_ranks())
    decoder = {str(i): {"content": token, "special": True} for token, i in BUNDLED_SPECIALS.items()}
    config = {"added_tokens_decoder": decoder, "eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    shutil.copy(BUNDLED_TOKENIZER_PATH / "chat_template.jinja", directory)
    return directory


@pytest.fixture(scope="module")
def kinds(tiktoken_dir) -> dict[str, object]:
    return {
        "library": build_tokenizer(BUNDLED_TOKENIZER_PATH),
        "auto": AutoTokenizer.from_pretrained(BUNDLED_TOKENIZER_PATH),
        "fast": PreTrainedTokenizerFast(
            tokenizer_file=str(BUNDLED_TOKENIZER_PATH / "tokenizer.json"),
            eos_token="<|endoftext|>",
            pad_token="<|pad|>",
            chat_template=OWN_TEMPLATE,
        ),
        "tiktoken": build_tokenizer(tiktoken_dir, pattern=GPT2_PATTERN),
    }


def own_render(kind: str, tokenizer) -> str:
    """The conversation as ``transformers`` renders it with the kind's own chat template."""
    hf = tokenizer if kind in ("auto", "fast") else AutoTokenizer.from_pretrained(BUNDLED_TOKENIZER_PATH)
    return hf.apply_chat_template(CONVERSATION, tokenize=False)


# -- tiktoken files --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "pattern", "reference_pattern"),
    [
        ("specials_first", GPT2_PATTERN, GPT2_PATTERN),  # the bundled ids: specials 0-3, ranks from 4
        ("specials_after", QWEN_PATTERN, QWEN_PATTERN),  # Qwen's: ranks from 0, specials right after them
        ("specials_with_gaps", LLAMA3_PATTERN, LLAMA3_PATTERN),  # cl100k's: unused ids between the specials
    ],
    ids=["specials_first", "specials_after", "specials_with_gaps"],
)
def test_a_tiktoken_file_encodes_as_the_tiktoken_package(tmp_path, layout, pattern, reference_pattern):
    """A tiktoken file and its special tokens give tiktoken's own ids for text and special tokens, decode back to
    the text, and have the EOS, pad and vocabulary size the file and the special tokens say."""
    ranks = bundled_ranks()
    if layout == "specials_first":
        specials = BUNDLED_SPECIALS
    else:
        ranks = {token: rank - 4 for token, rank in ranks.items()}
        gap = 0 if layout == "specials_after" else 5
        specials = {token: len(ranks) + gap * i + i for i, token in enumerate(BUNDLED_SPECIALS)}
    path = write_tiktoken(tmp_path / "vocab.tiktoken", ranks)
    tokenizer = build_tokenizer(path, special_tokens=specials, pattern=pattern, pad_token="<|pad|>")
    expected = tiktoken.Encoding("test", pat_str=reference_pattern, mergeable_ranks=ranks, special_tokens=specials)

    assert isinstance(tokenizer, TextTokenizer)
    for text in [*TEXTS, *corpus_texts(2)]:
        ids = tokenizer.encode(text)
        assert ids == expected.encode(text, allowed_special="all")
        assert tokenizer.decode(ids) == text == expected.decode(ids)
    assert (tokenizer.eod, tokenizer.pad_token_id) == (specials["<|endoftext|>"], specials["<|pad|>"])
    assert tokenizer.eod == expected.eot_token
    assert tokenizer.vocab_size == expected.n_vocab == max([*ranks.values(), *specials.values()]) + 1
    assert tokenizer.bos_token_id is None


def test_a_tiktoken_directory_names_its_special_tokens_and_chat_template_in_its_files(tmp_path, tiktoken_dir, kinds):
    """A directory with a tiktoken file takes its special tokens, EOS, pad and chat template from its
    tokenizer_config.json and chat_template.jinja; ``.hf.save_pretrained`` writes a tokenizer.json directory that
    loads with the same ids (the way to the command line)."""
    tokenizer = build_tokenizer(tiktoken_dir, pattern=GPT2_PATTERN)
    library = kinds["library"]
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.vocab_size) == (EOS, PAD, 8192)
    assert tokenizer.hf.chat_template == (BUNDLED_TOKENIZER_PATH / "chat_template.jinja").read_text(encoding="utf-8")
    assert tokenizer.fingerprint == library.fingerprint  # the same tokens under the same ids

    tokenizer.hf.save_pretrained(tmp_path / "saved")
    saved = build_tokenizer(tmp_path / "saved")
    assert (saved.eos_token_id, saved.pad_token_id) == (EOS, PAD)
    for text in TEXTS:
        assert saved.encode(text) == tokenizer.encode(text) == library.encode(text)


def test_tiktoken_errors_name_the_file_and_the_fix(tmp_path, tiktoken_dir):
    ranks = bundled_ranks()
    path = write_tiktoken(tmp_path / "vocab.tiktoken", ranks)
    with path.open("a") as file:
        file.write("not base64! 9000\n")
    with pytest.raises(DataConfigError, match=rf"vocab\.tiktoken, line {len(ranks) + 1}: .* 'base64-token rank'"):
        build_tokenizer(path)

    path = write_tiktoken(tmp_path / "vocab.tiktoken", ranks)
    with pytest.raises(DataConfigError, match=r"special token '<\|eot\|>': id 4 is already '!'; .* an id of its own"):
        build_tokenizer(path, special_tokens={"<|eot|>": 4}, pattern=GPT2_PATTERN)
    with pytest.raises(DataConfigError, match=r"the eos token '</s>' .* is not one of its special tokens"):
        build_tokenizer(path, special_tokens={"<|eot|>": 0}, eos_token="</s>", pattern=GPT2_PATTERN)
    with pytest.raises(DataConfigError, match=r"special_tokens: the id of '<\|eot\|>' must be a non-negative"):
        build_tokenizer(path, special_tokens={"<|eot|>": -1}, pattern=GPT2_PATTERN)
    with pytest.raises(DataConfigError, match=r"special_tokens, pattern apply to tiktoken files only"):
        build_tokenizer(BUNDLED_TOKENIZER_PATH, special_tokens={"<|eot|>": 9000}, pattern=GPT2_PATTERN)
    with pytest.raises(DataConfigError, match=r"eos_token apply to tiktoken files only"):
        build_tokenizer(build_tokenizer(tiktoken_dir, pattern=GPT2_PATTERN), eos_token="<|pad|>")

    shutil.copy(path, tmp_path / "other.tiktoken")
    with pytest.raises(DataConfigError, match=r"holds several tiktoken files \(other\.tiktoken, vocab\.tiktoken\)"):
        build_tokenizer(tmp_path)

    sentencepiece_like = tmp_path / "spm"
    sentencepiece_like.mkdir()
    (sentencepiece_like / "tokenizer.model").write_bytes(b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02")
    with pytest.raises(DataConfigError, match=r"has no tokenizer\.json"):
        build_tokenizer(sentencepiece_like)


# -- every kind, everywhere ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_reads_as_the_bundled_tokenizer(kind, kinds):
    """Each kind becomes a ``TextTokenizer`` with the bundled EOS, pad, vocabulary size and identity (so the same
    cache keys), and ``read_tokenizer`` (the Indexed path, the collators) reads the same."""
    tokenizer = build_tokenizer(kinds[kind])
    tokens = read_tokenizer(kinds[kind])
    library = kinds["library"]
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.vocab_size) == (EOS, PAD, 8192)
    assert (tokens.eod, tokens.pad, tokens.vocab_size, tokens.identity) == (EOS, PAD, 8192, library.fingerprint)
    assert build_online_text_collate_fn(tokenizer=kinds[kind]).pad_token_id == PAD


@pytest.mark.parametrize("kind", KINDS)
def test_the_transforms_give_the_bundled_ids_and_the_tokenizers_own_chat_template(kind, kinds, reference):
    """The plaintext transform gives the bundled ids and EOS; the conversation transform encodes what
    ``transformers`` renders with the kind's own chat template (the bundled ChatML one, or the PreTrainedTokenizerFast
    kind's, which reads ``eos_token``), also after a pickle round trip (as in a DataLoader worker)."""
    text = corpus_texts(1)[0]
    plaintext = build_llm_data_transform("plaintext", kinds[kind], max_seq_len=64)
    windows = plaintext({"text": text})
    expected = [*reference.encode(text, add_special_tokens=False).ids, EOS]
    assert [int(i) for w in windows for i in w["input_ids"]] + [int(windows[-1]["labels"][-1])] == expected

    rendered = own_render(kind, kinds[kind])
    assert rendered.startswith("system: Be brief.<|endoftext|>\n" if kind == "fast" else "<|im_start|>system\n")
    conversation = build_llm_data_transform("conversation", kinds[kind], chat_template="tokenizer")
    for transform in (conversation, pickle.loads(pickle.dumps(conversation))):
        (sample,) = transform({"conversation": CONVERSATION})
        ids = [*sample["input_ids"].tolist(), int(sample["labels"][-1])]
        assert ids == reference.encode(rendered, add_special_tokens=False).ids
        supervised = reference.decode([t for t in sample["labels"].tolist() if t != IGNORE_INDEX], False)
        assert supervised.strip().startswith(CONVERSATION[-1]["content"])  # the content, not the role header


@pytest.mark.parametrize("kind", KINDS)
def test_an_online_dataset_and_a_pipeline_give_the_same_samples_for_every_kind(kind, kinds, tmp_path, reference):
    """``build_online_text_dataset`` and ``build_dataloaders`` (whose get_batch takes the tokenizer's EOD) give the
    bundled tokenizer's samples and batches."""
    texts = corpus_texts(3, chars=600)
    data_path = tmp_path / "train.jsonl"
    data_path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    dataset = build_online_text_dataset(
        data_path=str(data_path),
        data_transform={"data_type": "plaintext", "max_seq_len": 4096},
        data_config={"dataset_type": "mapping", "cache_dir": str(tmp_path / "cache")},
        tokenizer=kinds[kind],
    )
    for index, text in enumerate(texts):
        (sample,) = dataset[index]
        assert sample["input_ids"].tolist() == reference.encode(text, add_special_tokens=False).ids
        assert sample["labels"][-1] == EOS

    config = {
        "dataset": {
            "_target_": "hyper_parallel.data.text.build_dataset.build_online_text_dataset",
            "data_path": str(data_path),
            "data_transform": {"data_type": "plaintext", "max_seq_len": 4096},
            "data_config": {"dataset_type": "mapping", "cache_dir": str(tmp_path / "cache")},
        },
        "dataloader": {"_target_": "hyper_parallel.data.batching.FixedBatchDataLoader"},
        "collate_fn": {"_target_": "hyper_parallel.data.batching.build_online_text_collate_fn"},
        "get_batch": {"_target_": "hyper_parallel.data.batching.ParallelBatch", "source_type": "online"},
    }
    loaders = build_dataloaders(config, tokenizer=kinds[kind], micro_batch_size=1)
    assert loaders.get_batch.eod_token_id == EOS
    by_path = build_dataloaders(config, tokenizer=str(BUNDLED_TOKENIZER_PATH), micro_batch_size=1)
    for batch, expected in zip(loaders.train, by_path.train, strict=True):
        assert batch.keys() == expected.keys()
        for key, value in batch.items():
            np.testing.assert_array_equal(np.asarray(value), np.asarray(expected[key]))


@pytest.mark.parametrize("kind", ["auto", "fast", "tiktoken"])
def test_the_indexed_datasets_and_their_cache_keys_are_the_same_for_every_kind(kind, kinds, tmp_path):
    """``build_indexed_text_dataset`` with a tokenizer object builds the bundled tokenizer's datasets, and names its
    index caches the same (the tokenizer's identity is part of their keys)."""
    corpus = write_corpus(tmp_path / "corpus_text_document", num_documents=60, seed=5)

    def build(tokenizer, cache: str):
        settings = {"seq_length": 16, "split": "90, 8, 2", "data_cache_path": str(tmp_path / cache)}
        return build_indexed_text_dataset(corpus, settings, [40, 4, 2], tokenizer)

    for got, want in zip(build(kinds[kind], "object"), build(kinds["library"], "library"), strict=True):
        assert_same_datasets(got, want)
    assert sorted(p.name for p in (tmp_path / "object").rglob("*")) == sorted(
        p.name for p in (tmp_path / "library").rglob("*")
    )


@pytest.mark.parametrize("kind", ["auto", "tiktoken"])
def test_offline_preparation_takes_a_tokenizer_object(kind, kinds, tmp_path, reference):
    """The offline preparation API, whose workers are separate processes, writes the bundled tokenizer's ids for a
    ``transformers`` object and a tiktoken tokenizer, and names the tokenizer by its path in the metadata."""
    texts = corpus_texts(3, chars=1500)
    data_path = tmp_path / "train.jsonl"
    data_path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    config = OfflinePreparationConfig(
        dataset_name_or_path=str(data_path),
        output_prefix=str(tmp_path / "out"),
        tokenizer_name_or_path=kinds[kind],
        workers=2,
        chunk_size=1,
    )
    summary = run_offline_preparation(config)
    reader = IndexedDataReader(summary.outputs["text"])
    documents = [reader[i].tolist() for i in range(len(reader))]
    assert documents == [[*reference.encode(t, add_special_tokens=False).ids, EOS] for t in texts]
    metadata = json.loads(Path(f"{summary.outputs['text']}.meta.json").read_text(encoding="utf-8"))
    assert metadata["tokenizer"] == build_tokenizer(kinds[kind]).name_or_path
    assert metadata["tokenizer_fingerprint"] == kinds["library"].fingerprint


# -- transformers objects ----------------------------------------------------------------------------------------------


def test_settings_made_on_a_transformers_object_do_not_reach_the_pipeline(kinds, reference):
    """``transformers`` leaves truncation on its Rust tokenizer after a call that asks for it: the pipeline encodes
    with its own copy, whole, before and after such a call, and the caller's object keeps its settings."""
    hf = AutoTokenizer.from_pretrained(BUNDLED_TOKENIZER_PATH)
    transform = build_llm_data_transform("plaintext", hf, max_seq_len=4096)
    hf(TEXTS[0], truncation=True, max_length=3)
    assert hf.backend_tokenizer.truncation is not None
    expected = reference.encode(TEXTS[0], add_special_tokens=False).ids
    assert transform({"text": TEXTS[0]})[0]["input_ids"].tolist() == expected
    truncated = build_llm_data_transform("plaintext", hf, max_seq_len=4096)
    assert truncated({"text": TEXTS[0]})[0]["input_ids"].tolist() == expected
    assert hf.backend_tokenizer.truncation is not None


def test_a_transformers_object_without_eos_keeps_none_and_says_how_to_name_one():
    """A bare ``PreTrainedTokenizerFast`` has no EOS: none is guessed for it (its own special tokens are used), and
    the help names the attribute to set."""
    bare = build_tokenizer(PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED_TOKENIZER_PATH / "tokenizer.json")))
    assert (bare.eos_token_id, bare.pad_token_id) == (None, None)
    assert "tokenizer.eos_token = '<|endoftext|>'" in bare.eos_help()
    with pytest.raises(DataConfigError, match=r"tokenizer must be a TextTokenizer, a transformers tokenizer object"):
        build_tokenizer(Tokenizer.from_file(str(BUNDLED_TOKENIZER_PATH / "tokenizer.json")))


# -- a chat template carries its tokenizer -----------------------------------------------------------------------------


def test_a_conversation_transform_takes_its_tokenizer_from_the_chat_template(kinds, tmp_path):
    """``TextConversationTransform`` and ``build_llm_data_transform`` with a ``ChatTemplate`` need no separate
    tokenizer; passing another tokenizer than the template's is refused."""
    template = ChatMLTemplate(kinds["auto"])
    record = {"conversation": CONVERSATION}
    with_tokenizer = TextConversationTransform(kinds["library"], chat_template="chatml")(record)[0]
    for transform in (
        TextConversationTransform(chat_template=template),
        build_llm_data_transform("conversation", chat_template=template, max_seq_len=64),
        build_llm_data_transform("conversation", kinds["library"], chat_template=template),
    ):
        (sample,) = transform(record)
        for key in ("input_ids", "labels"):
            np.testing.assert_array_equal(sample[key], with_tokenizer[key])

    other = tmp_path / "other"
    shutil.copytree(BUNDLED_TOKENIZER_PATH, other)
    backend = Tokenizer.from_file(str(other / "tokenizer.json"))
    backend.add_special_tokens(["<|extra|>"])
    backend.save(str(other / "tokenizer.json"))
    with pytest.raises(DataConfigError, match=r"encodes with another tokenizer than tokenizer .*other"):
        TextConversationTransform(other, chat_template=template)
