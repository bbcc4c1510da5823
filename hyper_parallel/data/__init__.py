"""hyper_parallel.data: raw text and tokenized corpora to the exact batches a distributed LLM trainer consumes.

Subpackages: ``indexed`` (Megatron ``.idx``/``.bin`` datasets), ``text`` (tokenizers, chat templates, transforms and
the Online sources), ``batching`` (loaders, collators, pipelines from configs), ``parallel`` (DP batch sampler,
rank-0-first builds), ``tools`` (offline preparation and inspection commands); ``vlm`` keeps the reserved
multimodal interfaces (not available yet, not exported here). See ``README.md`` beside this file for the data flow.
"""

__version__ = "0.1.0"
