"""Typed, validated configuration of offline preparation, and its command-line flags.

Owns: the option names, defaults and checks of ``offline_preparation`` and ``huggingface_offline``.
Not responsible for: reading inputs or tokenizing (``offline_preparation``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.indexed.object_upload import DEFAULT_PART_BYTES, check_part_bytes
from hyper_parallel.data.indexed.pair_metadata import LOSS_MASK_SUFFIX
from hyper_parallel.data.text.text_template import TextTemplate

__all__ = [
    "MAX_PARTITIONS",
    "TOKEN_DTYPES",
    "OfflinePreparationConfig",
    "add_preparation_arguments",
    "config_from_args",
    "parse_bool",
]

# The integer dtypes an .idx file can hold tokens in (its float codes are not token dtypes).
TOKEN_DTYPES = ("uint8", "int8", "int16", "uint16", "int32", "int64")
# Partitions bound packing buffers; thousands already mean tiny partitions, and each one is a file while writing.
MAX_PARTITIONS = 4096


def parse_bool(value: str | bool) -> bool:
    """Parse ``true/false/1/0/yes/no/on/off`` (any case), for flags written as ``--append-eod true``."""
    if isinstance(value, bool):
        return value
    lowered = value.strip().lower()
    if lowered in {"true", "1", "yes", "on"}:
        return True
    if lowered in {"false", "0", "no", "off"}:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class OfflinePreparationConfig:
    """What to tokenize, how, and where to write it.

    Attributes:
        dataset_name_or_path: a file, a glob, or a directory of ``.json``/``.jsonl`` (optionally ``.gz``),
            ``.parquet``, ``.csv`` (optionally ``.gz``), ``.arrow`` or ``.txt`` (optionally ``.gz``) files.
        output_prefix: outputs are ``<output_prefix>_<key>_document.{bin,idx}``; an fsspec URL
            (``s3://bucket/dir/name``) builds them in a local staging directory and uploads them there.
        tokenizer_name_or_path: a local Hugging Face tokenizer directory or ``tokenizer.json``, a tiktoken file, or
            (from Python) a loaded tokenizer: anything ``text.build_tokenizer.build_tokenizer`` takes, such as a
            ``transformers`` tokenizer object.
        json_keys: record fields to tokenize; one output pair per key.
        append_eod: append the tokenizer's EOS token to every non-empty document.
        add_special_tokens: let the tokenizer add its own special tokens (e.g. BOS), as ``tokenizer(text)`` does.
        pack_to_seq_len: if set to N, concatenate documents and write fixed records of N + 1 tokens; each
            partition packs on its own and drops its tail shorter than N + 1. With ``chat_template`` the loss
            mask is packed into the same records.
        text_template: a ``str.format`` template over record fields (e.g. ``"{title}\\n\\n{text}"``) whose result
            is tokenized instead of the raw field; needs exactly one json key, which names the output.
        chat_template: the records are conversations under the one json key (or, with ``instruction_key``,
            instruction records), rendered by this chat template (``tokenizer``, ``chatml``, ``llama2``,
            ``default``, ``gpt_oss``) as the Online ``conversation`` (``instruction``) transform renders them;
            beside the tokens ``<prefix>_<key>_document`` the run writes their loss mask
            ``<prefix>_<key>_document_loss_mask`` (uint8 0/1, 1 where the token is a supervised target). The
            template adds its own special tokens (``add_special_tokens`` is not used); an appended EOD has mask 0.
        role_map: with ``chat_template``, dataset role -> template role (e.g. ``{"customer": "user"}``), before
            the built-in aliases (``human``, ``gpt``...).
        instruction_key: with ``chat_template``, the records are instruction records (Alpaca style) and this field
            holds the instruction: each becomes ``user: instruction`` (then a blank line and the input, when the
            record has a non-empty one) and ``assistant: output``, tokenized as the Online ``instruction``
            transform (``InstructionTransform``) tokenizes it, only the answer supervised. The one json key names
            the output. None: the records are conversations.
        input_key: with ``instruction_key``, the field with the optional input (default ``input``; absent, null
            or empty: none). Parquet, Arrow and Hugging Face inputs must have the column.
        output_key: with ``instruction_key``, the field with the answer (default ``output``).
        workers: tokenizer processes (default: the number of CPUs).
        partitions: independent partitions (own packing buffer each), merged into the final prefix at the end.
        keep_sequential_samples: give partitions contiguous blocks of records instead of round-robin.
        keep_partition_files: keep the per-partition outputs after merging, listed by a manifest written last.
        skip_bad_records: count and skip malformed records instead of stopping at the first.
        token_dtype: force the token dtype, one of ``TOKEN_DTYPES``; default is Megatron's choice from the
            vocabulary.
        overwrite: replace existing outputs of the same prefix (they stay intact until the new ones are complete);
            without it a run over existing outputs is refused before anything is tokenized.
        log_interval: log progress every this many documents.
        chunk_size: records handed to a worker at a time.
        upload_part_bytes: with a URL ``output_prefix``, the part size of multipart uploads (at least 5 MiB).
    """

    dataset_name_or_path: str
    output_prefix: str
    tokenizer_name_or_path: str
    json_keys: tuple[str, ...] = ("text",)
    append_eod: bool = True
    add_special_tokens: bool = True
    pack_to_seq_len: int | None = None
    text_template: str | None = None
    chat_template: str | None = None
    role_map: Mapping[str, str] | None = None
    instruction_key: str | None = None
    input_key: str | None = None
    output_key: str | None = None
    workers: int = field(default_factory=lambda: max(1, os.cpu_count() or 1))
    partitions: int = 1
    keep_sequential_samples: bool = False
    keep_partition_files: bool = False
    skip_bad_records: bool = False
    token_dtype: str | None = None
    overwrite: bool = False
    log_interval: int = 1000
    chunk_size: int = 4096
    upload_part_bytes: int = DEFAULT_PART_BYTES

    def __post_init__(self) -> None:
        if isinstance(self.json_keys, str):
            object.__setattr__(self, "json_keys", (self.json_keys,))
        object.__setattr__(self, "json_keys", tuple(self.json_keys))
        if not self.json_keys or any(not key for key in self.json_keys):
            raise DataConfigError(f"json_keys must name at least one record field, got {self.json_keys!r}")
        if len(set(self.json_keys)) != len(self.json_keys):
            raise DataConfigError(f"json_keys has duplicates: {self.json_keys!r}; each key writes one output pair")
        if self.text_template is not None:
            TextTemplate(self.text_template)  # checked before any file is read
            if len(self.json_keys) != 1:
                raise DataConfigError(
                    f"text_template renders one document per record, so it needs exactly one json key to name the "
                    f"output, got {self.json_keys!r}"
                )
        self._check_conversation_settings()
        for name in ("workers", "partitions", "log_interval", "chunk_size"):
            value = getattr(self, name)
            if value < 1:
                raise DataConfigError(f"{name} must be at least 1, got {value}")
        if self.partitions > MAX_PARTITIONS:
            raise DataConfigError(
                f"partitions must be at most {MAX_PARTITIONS}, got {self.partitions}; partitions only bound the "
                "packing buffers, so use fewer"
            )
        if self.pack_to_seq_len is not None and self.pack_to_seq_len < 1:
            raise DataConfigError(f"pack_to_seq_len must be a positive token count, got {self.pack_to_seq_len}")
        if self.token_dtype is not None and str(self.token_dtype) not in TOKEN_DTYPES:
            raise DataConfigError(
                f"token_dtype must be an integer type that .idx files store, one of {', '.join(TOKEN_DTYPES)}; "
                f"got {self.token_dtype!r}"
            )
        check_part_bytes(self.upload_part_bytes)
        if not self.output_prefix:
            raise DataConfigError("output_prefix must not be empty")
        object.__setattr__(self, "output_prefix", os.path.expanduser(self.output_prefix))

    def _check_conversation_settings(self) -> None:
        if self.chat_template is None:
            if self.role_map is not None:
                raise DataConfigError("role_map renames the roles of conversations; it needs --chat-template")
            if self.instruction_key is not None:
                raise DataConfigError(
                    "instruction_key reads instruction records, which a chat template renders; it needs "
                    "--chat-template (e.g. --chat-template tokenizer)"
                )
            self._check_instruction_fields()
            return
        if not isinstance(self.chat_template, str) or not self.chat_template:
            raise DataConfigError(f"chat_template must be a chat template name, got {self.chat_template!r}")
        if self.text_template is not None:
            raise DataConfigError(
                f"chat_template renders conversations, which cannot be combined with text_template "
                f"({self.text_template!r}); drop one of them"
            )
        if len(self.json_keys) != 1:
            what = (
                "names the output"
                if self.is_instruction
                else "is the field with the messages, e.g. --json-keys messages"
            )
            raise DataConfigError(
                f"chat_template writes one document per record, so it needs exactly one json key (which {what}), "
                f"got {self.json_keys!r}"
            )
        self._check_instruction_fields()

    def _check_instruction_fields(self) -> None:
        if not self.is_instruction:
            for name in ("input_key", "output_key"):
                if getattr(self, name) is not None:
                    raise DataConfigError(
                        f"{name} names a field of instruction records; set instruction_key too (the field with the "
                        "instruction, e.g. --instruction-key instruction), or drop it"
                    )
            return
        if self.role_map is not None:
            raise DataConfigError(
                "role_map renames the roles of conversations; instruction records have fixed roles (user asks, "
                "assistant answers), so drop it"
            )
        for name, default in (("input_key", "input"), ("output_key", "output")):
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        fields = self.instruction_fields
        if any(not isinstance(name, str) or not name for name in fields):
            raise DataConfigError(f"instruction_key, input_key and output_key must be field names, got {list(fields)}")
        if len(set(fields)) != len(fields):
            raise DataConfigError(
                f"instruction_key, input_key and output_key must name three different fields, got {list(fields)}"
            )

    @property
    def is_instruction(self) -> bool:
        """Whether the records are instruction records (``instruction_key`` is set) rather than conversations."""
        return self.instruction_key is not None

    @property
    def instruction_fields(self) -> tuple[str, ...]:
        """``(instruction_key, input_key, output_key)`` of instruction records; empty for other records."""
        return (self.instruction_key, self.input_key, self.output_key) if self.is_instruction else ()

    @property
    def output_suffixes(self) -> tuple[str, ...]:
        """The pairs written per json key, by the suffix of their prefix: the tokens (``""``), and with a chat
        template the loss mask (``LOSS_MASK_SUFFIX``)."""
        return ("",) if self.chat_template is None else ("", LOSS_MASK_SUFFIX)

    @property
    def template(self) -> TextTemplate | None:
        """The ``text_template`` that renders each record, named by its flag in the messages of the records it
        cannot render."""
        return None if self.text_template is None else TextTemplate(self.text_template, "--text-template")

    @property
    def record_fields(self) -> list[str]:
        """The record fields (columns) a run reads: those of instruction records or of ``text_template``, else the
        json keys."""
        if self.is_instruction:
            return list(self.instruction_fields)
        template = self.template
        return list(self.json_keys if template is None else template.fields)

    def output_prefix_for(self, key: str, suffix: str = "") -> str:
        """The final path prefix of the output for ``key`` (``suffix``: of its loss mask, see ``output_suffixes``)."""
        return f"{self.output_prefix}_{key}_document{suffix}"


def _role_entry(value: str) -> tuple[str, str]:
    raw, separator, role = value.partition("=")
    if not separator or not raw or not role:
        raise argparse.ArgumentTypeError(f"expected DATASET_ROLE=ROLE such as human=user, got {value!r}")
    return raw, role


def add_preparation_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every flag except the input one (which differs between the local and Hugging Face tools)."""
    parser.add_argument(
        "--output-prefix",
        required=True,
        help="outputs are <prefix>_<key>_document.{bin,idx}; an fsspec URL (s3://bucket/dir/name) uploads them",
    )
    parser.add_argument(
        "--tokenizer-name-or-path", required=True, help="local Hugging Face tokenizer directory or tokenizer.json"
    )
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="record fields to tokenize (default: text)")
    parser.add_argument(
        "--append-eod", type=parse_bool, default=True, metavar="BOOL", help="append EOS to each document (default true)"
    )
    parser.add_argument(
        "--add-special-tokens",
        type=parse_bool,
        default=True,
        metavar="BOOL",
        help="let the tokenizer add its special tokens such as BOS (default true)",
    )
    parser.add_argument(
        "--pack-to-seq-len",
        type=int,
        default=None,
        metavar="N",
        help="pack documents into records of N+1 tokens (for is_dataset_from_mr: true); tails are dropped",
    )
    parser.add_argument(
        "--text-template", default=None, help='str.format template over record fields, e.g. "{title}\\n\\n{text}"'
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="NAME",
        help="the json key holds conversations rendered by this chat template (tokenizer, chatml, llama2, default, "
        "gpt_oss); also writes <prefix>_<key>_document_loss_mask.{bin,idx}",
    )
    parser.add_argument(
        "--role-map",
        nargs="+",
        default=None,
        metavar="ROLE=ROLE",
        type=_role_entry,
        help="with --chat-template: dataset roles to template roles, e.g. customer=user agent=assistant",
    )
    parser.add_argument(
        "--instruction-key",
        default=None,
        metavar="FIELD",
        help="with --chat-template: the records are instruction records (Alpaca style) with the instruction in "
        "FIELD, rendered as user: instruction (+ input) and assistant: output; the json key names the output",
    )
    parser.add_argument(
        "--input-key",
        default=None,
        metavar="FIELD",
        help="with --instruction-key: the field with the optional input (default input)",
    )
    parser.add_argument(
        "--output-key",
        default=None,
        metavar="FIELD",
        help="with --instruction-key: the field with the answer, the only supervised part (default output)",
    )
    parser.add_argument("--workers", type=int, default=max(1, os.cpu_count() or 1), help="tokenizer processes")
    parser.add_argument("--partitions", type=int, default=1, help="independent partitions merged at the end")
    parser.add_argument(
        "--keep-sequential-samples",
        action="store_true",
        help="assign contiguous record blocks to partitions instead of round-robin",
    )
    parser.add_argument("--keep-partition-files", action="store_true", help="keep per-partition outputs after merge")
    parser.add_argument(
        "--skip-bad-records", action="store_true", help="count and skip malformed records instead of stopping"
    )
    parser.add_argument(
        "--dtype", dest="token_dtype", default=None, help=f"force the token dtype: {', '.join(TOKEN_DTYPES)}"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace existing outputs of --output-prefix (default: refuse)"
    )
    parser.add_argument("--log-interval", type=int, default=1000, help="log progress every N documents")
    parser.add_argument("--chunk-size", type=int, default=4096, help="at most this many records per worker task")
    parser.add_argument(
        "--upload-part-bytes",
        type=int,
        default=DEFAULT_PART_BYTES,
        help=f"with a URL --output-prefix: the part size of multipart uploads (default {DEFAULT_PART_BYTES})",
    )


def config_from_args(args: argparse.Namespace) -> OfflinePreparationConfig:
    """Build the config from parsed flags; invalid combinations raise DataConfigError."""
    return OfflinePreparationConfig(
        dataset_name_or_path=args.dataset_name_or_path,
        output_prefix=args.output_prefix,
        tokenizer_name_or_path=args.tokenizer_name_or_path,
        json_keys=tuple(args.json_keys),
        append_eod=args.append_eod,
        add_special_tokens=args.add_special_tokens,
        pack_to_seq_len=args.pack_to_seq_len,
        text_template=args.text_template,
        chat_template=args.chat_template,
        role_map=None if args.role_map is None else dict(args.role_map),
        instruction_key=args.instruction_key,
        input_key=args.input_key,
        output_key=args.output_key,
        workers=args.workers,
        partitions=args.partitions,
        keep_sequential_samples=args.keep_sequential_samples,
        keep_partition_files=args.keep_partition_files,
        skip_bad_records=args.skip_bad_records,
        token_dtype=args.token_dtype,
        overwrite=args.overwrite,
        log_interval=args.log_interval,
        chunk_size=args.chunk_size,
        upload_part_bytes=args.upload_part_bytes,
    )
