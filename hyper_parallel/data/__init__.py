"""hyper_parallel.data: raw text and tokenized corpora to the exact batches a distributed LLM trainer consumes.

Subpackages: ``indexed`` (Megatron ``.idx``/``.bin`` datasets), ``text`` (tokenizers and raw-record sources),
``tools`` (offline preparation and inspection commands). See ``README.md`` beside this file for the data flow.
"""

__version__ = "0.1.0"
