"""Train a small GPT on the bundled Jane Austen chapters, fed by a hyper_parallel.data pipeline on CPU gloo ranks.

What it shows: a pipeline config built by ``build_dataloaders`` with a ``DataLoaderParallelContext``, whose
``get_batch`` node (``ParallelBatch``) hands every rank of a DP x CP x TP mesh its ``(model_inputs, loss_inputs)``;
a model (``tiny_gpt.TinyGPT``) that attends exactly over the CP-sharded tokens (keys and values all-gathered over
the CP group, masks that never cross a document, rotary positions from ``position_ids``); and a checkpoint of
model, optimizer and data-loader state from which a resumed run continues with bit-identical batches and the same
loss curve.

Run it from the repository root (it spawns its own gloo ranks on free local ports)::

    .venv/bin/python examples/train_tiny_gpt.py                       # DP2 x CP2: 4 processes, 300 steps
    .venv/bin/python examples/train_tiny_gpt.py --tp 2                # DP2 x CP2 x TP2: 8 processes
    .venv/bin/python examples/train_tiny_gpt.py --dp 1 --tp 2         # CP2 x TP2: 4 processes (a small machine)
    .venv/bin/torchrun --nproc-per-node 4 examples/train_tiny_gpt.py  # the same 4 ranks, started by torchrun
    .venv/bin/python examples/train_tiny_gpt.py --steps 100 --save-dir checkpoints
    .venv/bin/python examples/train_tiny_gpt.py --steps 300 --save-dir checkpoints --resume
    .venv/bin/python examples/train_tiny_gpt.py --config examples/online_mapping_dynamic.yaml  # after the quickstart

The default pipeline reads the bundled corpus with the Online path (a mapping source, plaintext windows of
``--seq-len`` tokens, cyclic order), packs each DP rank's windows into token-budget micro-batches
(``DynamicBatchDataLoader``, ``--micro-batch-size`` windows' worth of tokens) and delivers them with
``attention_mode: packed`` and ``cp_layout: zigzag_thd``, position ids restarting at every window. Every step,
each DP replica trains on one micro-batch: the CP ranks of a replica each hold their zigzag half of it, the TP
ranks of a (DP, CP) coordinate receive identical batches by broadcast and compute the same (replicated) weights.
Gradients are summed over the DP x CP ranks and divided by the step's loss tokens. A DP rank whose data runs out
starts its next epoch on its own, so unequal micro-batch counts per epoch never stall a step (the warning
``build_dataloaders`` gives about them concerns loops that train on every micro-batch of an epoch at once).

Not responsible for: anything a real trainer adds (mixed precision, tensor-parallel weights, evaluation).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import disable_progress_bars
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tiny_gpt.py beside this file, also when imported
from tiny_gpt import CPAttention, TinyGPT  # noqa: E402

from hyper_parallel.data.batching.dataloader import build_dataloaders  # noqa: E402
from hyper_parallel.data.batching.get_batch import ParallelBatch  # noqa: E402
from hyper_parallel.data.constants import IGNORE_INDEX  # noqa: E402
from hyper_parallel.data.dataset_logging import enable_dataset_logging  # noqa: E402
from hyper_parallel.data.file_writes import atomic_file  # noqa: E402
from hyper_parallel.data.parallel.process_groups import ProcessGroupCollection  # noqa: E402
from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH  # noqa: E402
from hyper_parallel.data.tokenizer_protocol import read_tokenizer  # noqa: E402
from hyper_parallel.data.tools.example_data import BUNDLED_CORPUS_PATH  # noqa: E402

__all__ = [
    "BUNDLED_CORPUS_PATH",
    "default_pipeline",
    "latest_checkpoint",
    "load_checkpoint",
    "main",
    "parse_args",
    "run_rank",
    "save_checkpoint",
    "summary",
]

# The settings a checkpoint must have been saved with to be resumed (the others may change between runs).
_RESUMED_SETTINGS = (
    "config", "tokenizer", "seq_len", "micro_batch_size", "dp", "cp", "tp", "width", "heads", "layers", "lr", "seed",
)  # fmt: skip


def default_pipeline(seq_len: int, cache_dir: str | None = None) -> dict:
    """The pipeline config of the default run: the bundled corpus, Online path, packed ``zigzag_thd`` delivery.

    Args:
        seq_len: the plaintext transform's ``max_seq_len``: chapters are cut into windows of this many tokens.
        cache_dir: where Hugging Face ``datasets`` keeps the corpus' Arrow cache (None: its default).
    """
    return {
        "dataset": {
            "_target_": "hyper_parallel.data.text.build_dataset.build_online_text_dataset",
            "data_path": str(BUNDLED_CORPUS_PATH),
            "data_transform": {
                "_target_": "hyper_parallel.data.text.build_data_transform.build_llm_data_transform",
                "data_type": "plaintext",
                "text_keys": "text",
                "max_seq_len": seq_len,
            },
            "data_config": {"dataset_type": "mapping", "cache_dir": cache_dir},
        },
        "dataloader": {
            "_target_": "hyper_parallel.data.batching.DynamicBatchDataLoader",
            "min_buffered_samples": 32,
            "sampler_type": "cyclic",
        },
        "collate_fn": {"_target_": "hyper_parallel.data.batching.build_online_text_collate_fn"},
        "get_batch": {
            "_target_": "hyper_parallel.data.batching.ParallelBatch",
            "source_type": "online",
            "attention_mode": "packed",
            "cp_layout": "zigzag_thd",
            "reset_position_ids": True,
        },
    }


# -- one step -----------------------------------------------------------------------------------------------------


def masked_loss_sum(logits: torch.Tensor, loss_inputs: Mapping) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed next-token loss where ``loss_mask`` is 1, and how many tokens that is (labels are shifted)."""
    per_token = F.cross_entropy(
        logits.flatten(0, 1), loss_inputs["labels"].flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    mask = loss_inputs["loss_mask"].flatten()
    return (per_token * mask).sum(), mask.sum()


def batch_digest(model_inputs: Mapping, loss_inputs: Mapping) -> str:
    """A short hash of what this rank trains on in a step (tokens, labels, positions, loss mask)."""
    digest = hashlib.blake2b(digest_size=8)
    for tensor in (model_inputs["input_ids"], model_inputs["labels"], model_inputs["position_ids"]):
        digest.update(tensor.contiguous().numpy().tobytes())
    digest.update(loss_inputs["loss_mask"].contiguous().numpy().tobytes())
    return digest.hexdigest()


class _Batches:
    """This rank's micro-batches, epoch after epoch: a data rank starts its next epoch when its loader runs out."""

    def __init__(self, get_batch: ParallelBatch, loader) -> None:
        self.get_batch, self.loader = get_batch, loader
        self.iterator = None if loader is None else iter(loader)

    def next(self) -> tuple[dict, dict]:
        try:
            return self.get_batch(self.iterator)
        except StopIteration:  # every rank of the TP group stops at the same call
            self.iterator = None if self.loader is None else iter(self.loader)
            return self.get_batch(self.iterator)


def _all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, group=group)
    return tensor


def _reduce_gradients(model: torch.nn.Module, group, loss_tokens: float) -> None:
    """Sum every parameter's gradient over the DP x CP ranks (one flat all-reduce) and divide by the loss tokens."""
    parameters = [p for p in model.parameters() if p.grad is not None]
    flat = _all_reduce(torch.cat([p.grad.flatten() for p in parameters]), group) / max(loss_tokens, 1.0)
    for parameter, reduced in zip(parameters, flat.split([p.numel() for p in parameters]), strict=True):
        parameter.grad.copy_(reduced.view_as(parameter))


# -- checkpoints --------------------------------------------------------------------------------------------------


def _save_atomically(state, path: Path) -> None:
    """Write under a temporary name, then rename: a crash never leaves a half-written file under ``path``, and a
    symbolic link planted at either name is refused, never written through."""
    with atomic_file(path) as file:
        if path.suffix == ".json":
            file.write(json.dumps(state, indent=1).encode("utf-8"))
        else:
            torch.save(state, file)


def save_checkpoint(save_dir: Path, step: int, rank: int, model, optimizer, loaders, settings: dict) -> None:
    """Every rank calls it. Rank 0 writes the model and optimizer (replicated), every rank its pipeline's loader
    state (``DataLoaders.state_dict``: every split's position, None on ranks that read no data);
    then rank 0 points ``latest.json`` at the new step directory (the commit) and removes the older ones."""
    directory = save_dir / f"step_{step:07d}"
    directory.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        _save_atomically(
            {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, directory / "trainer.pt"
        )
    _save_atomically(loaders.state_dict(), directory / f"data_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        _save_atomically({"step": step, "directory": directory.name, "settings": settings}, save_dir / "latest.json")
        for older in save_dir.glob("step_*"):
            if older != directory and older.is_dir():
                shutil.rmtree(older)
    dist.barrier()


def latest_checkpoint(save_dir: Path, settings: dict) -> Path:
    """The step directory ``latest.json`` of ``save_dir`` names, once its settings are those of this run.

    Raises:
        FileNotFoundError: there is no ``latest.json`` (nothing was saved there).
        ValueError: the checkpoint was saved with other settings (named, with both values).
    """
    latest = save_dir / "latest.json"
    if not latest.is_file():
        raise FileNotFoundError(f"--resume: {latest} does not exist; run once with --save-dir {save_dir} first")
    saved = json.loads(latest.read_text(encoding="utf-8"))
    differing = [
        f"{name} (saved {saved['settings'].get(name)!r}, now {settings[name]!r})"
        for name in _RESUMED_SETTINGS
        if saved["settings"].get(name) != settings[name]
    ]
    if differing:
        raise ValueError(
            f"--resume: the checkpoint in {save_dir} was saved with other settings: {', '.join(differing)}; resume "
            "with the settings it was saved with, or start without --resume"
        )
    return save_dir / saved["directory"]


def load_checkpoint(save_dir: Path, rank: int, settings: dict, model, optimizer, loaders) -> int:
    """Restore the latest checkpoint of ``save_dir`` on this rank; returns the step it was saved after."""
    directory = latest_checkpoint(save_dir, settings)
    trainer = torch.load(directory / "trainer.pt", weights_only=True)
    model.load_state_dict(trainer["model"])
    optimizer.load_state_dict(trainer["optimizer"])
    loaders.load_state_dict(torch.load(directory / f"data_rank{rank}.pt", weights_only=True))
    return int(trainer["step"])


# -- the ranks ----------------------------------------------------------------------------------------------------


def _settings(args: argparse.Namespace) -> dict:
    values = {name: getattr(args, name) for name in _RESUMED_SETTINGS}
    values["config"] = "bundled corpus" if args.config is None else str(args.config)
    values["tokenizer"] = str(args.tokenizer)
    return values


def run_rank(args: argparse.Namespace, rank: int, world_size: int, *, keep_batches: bool = False) -> dict:
    """Train on this rank of an initialised gloo process group; every rank calls it with the same ``args``.

    Args:
        args: the parsed command line (``parse_args``).
        rank, world_size: this process's global rank and the number of processes (``dp * cp * tp``).
        keep_batches: also return this rank's ``input_ids``, ``labels`` and ``position_ids`` of every step.

    Returns:
        This rank's record of the run: its ``dp``, ``cp`` and ``tp`` ranks, ``first_step``, the global ``losses``
        of the steps it ran, the ``digests`` of its batches (``batch_digest``), the global ``tokens`` it trained
        on and ``seconds`` spent, and with ``keep_batches`` the ``batches``.
    """
    if args.dp * args.cp * args.tp != world_size:
        raise ValueError(
            f"--dp {args.dp} x --cp {args.cp} x --tp {args.tp} is {args.dp * args.cp * args.tp} ranks, but "
            f"{world_size} processes run; make the product equal to the number of processes"
        )
    torch.set_num_threads(args.threads)
    enable_dataset_logging("warning", ranks=(0,))
    disable_progress_bars()  # Hugging Face datasets' bars: the training bar is the only one
    mesh = init_device_mesh("cpu", (args.dp, args.cp, args.tp), mesh_dim_names=("dp", "cp", "tp"))
    groups = ProcessGroupCollection.from_mesh(mesh)
    context = groups.parallel_context()
    config = default_pipeline(args.seq_len, args.cache_dir) if args.config is None else args.config
    loaders = build_dataloaders(
        config,
        tokenizer=args.tokenizer,
        micro_batch_size=args.micro_batch_size,
        seed=args.seed,
        train_valid_test_num_samples=[None, 0, 0],  # one epoch of train at a time; no evaluation, so no such loaders
        parallel_context=context,
    )
    get_batch = loaders.get_batch
    if not isinstance(get_batch, ParallelBatch):
        raise ValueError(
            f"the pipeline config {args.config} has no get_batch node (a ParallelBatch); add one, e.g. "
            "get_batch: {_target_: hyper_parallel.data.batching.ParallelBatch, source_type: online}"
        )

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = TinyGPT(
        read_tokenizer(loaders.tokenizer).vocab_size, width=args.width, heads=args.heads, layers=args.layers
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    settings = _settings(args)
    first_step = 0
    if args.resume:
        first_step = load_checkpoint(args.save_dir, rank, settings, model, optimizer, loaders)
    batches = _Batches(get_batch, loaders.train)

    record = {"dp": context.dp_rank, "cp": context.cp_rank, "tp": context.tp_rank, "first_step": first_step}
    record.update(losses=[], digests=[], tokens=0, seconds=0.0)
    if keep_batches:
        record["batches"] = []
    if rank == 0:
        parameters = sum(p.numel() for p in model.parameters())
        print(
            f"DP{args.dp} x CP{args.cp} x TP{args.tp} on {world_size} gloo ranks; {get_batch!r}\n"
            f"TinyGPT: {parameters:,} parameters; steps {first_step} to {args.steps}"
            + (f" (resumed from {args.save_dir})" if args.resume else ""),
            flush=True,
        )
    progress = tqdm(total=args.steps, initial=first_step, unit="step", disable=rank != 0 or args.quiet)
    started = time.perf_counter()
    for step in range(first_step, args.steps):
        model_inputs, loss_inputs = batches.next()
        attention = CPAttention.from_model_inputs(
            model_inputs, cp_layout=get_batch.cp_layout, cp_group=context.cp_group
        )
        logits = model(model_inputs["input_ids"], model_inputs["position_ids"], attention)
        loss_sum, loss_tokens = masked_loss_sum(logits, loss_inputs)
        loss_sum.backward()  # every rank of the CP group runs it: the key/value gather's backward
        totals = torch.tensor(
            [float(loss_sum.detach()), float(loss_tokens), model_inputs["input_ids"].numel()], dtype=torch.float64
        )
        loss_total, loss_token_total, token_total = _all_reduce(totals, groups.dp_cp).tolist()
        _reduce_gradients(model, groups.dp_cp, loss_token_total)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        loss = loss_total / max(loss_token_total, 1.0)
        record["losses"].append(loss)
        record["digests"].append(batch_digest(model_inputs, loss_inputs))
        record["tokens"] += int(token_total)
        if keep_batches:
            record["batches"].append({k: model_inputs[k].tolist() for k in ("input_ids", "labels", "position_ids")})
        elapsed = time.perf_counter() - started
        progress.set_postfix(loss=f"{loss:.3f}", tokens_per_s=f"{record['tokens'] / elapsed:,.0f}", refresh=False)
        progress.update()
        done = step + 1
        if args.save_dir is not None and (done == args.steps or (args.save_every and done % args.save_every == 0)):
            save_checkpoint(args.save_dir, done, rank, model, optimizer, loaders, settings)
    progress.close()
    record["seconds"] = time.perf_counter() - started
    if rank == 0 and record["losses"]:
        print(summary(record), flush=True)
    return record


def summary(record: dict, window: int = 10) -> str:
    """One line: the mean loss over the first and over the last steps, tokens and throughput.

    Each window holds at most ``window`` steps and at most half the run, so the two never share a step (a 3-step run
    compares its first step with its last); a 1-step run has nothing to compare.
    """
    losses = record["losses"]
    end = record["first_step"] + len(losses)
    size = min(window, len(losses) // 2)
    if size == 0:
        loss = f"loss {losses[0]:.3f} at its only step, nothing to compare"
    else:
        first, last = losses[:size], losses[-size:]
        unit = "step" if size == 1 else f"{size} steps"
        loss = f"mean loss {sum(first) / size:.3f} over the first {unit} -> {sum(last) / size:.3f} over the last {unit}"
    rate = record["tokens"] / max(record["seconds"], 1e-9)
    return (
        f"steps {record['first_step']}-{end}: {loss}; {record['tokens']:,} tokens in {record['seconds']:.1f} s, "
        f"{rate:,.0f} tokens/s"
    )


# -- starting the ranks -------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _spawned_rank(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        run_rank(args, rank, world_size)
    finally:
        dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="train_tiny_gpt.py",
        description="Train a small GPT on CPU gloo ranks (DP x CP x TP), fed by a hyper_parallel.data pipeline: "
        "the bundled Jane Austen corpus through the Online path by default.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of the whole run (a resumed run too)")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel size")
    parser.add_argument("--cp", type=int, default=2, help="context-parallel size")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (2: TP peers get identical batches)")
    parser.add_argument(
        "--config", type=Path, help="a pipeline YAML with a get_batch node, e.g. examples/online_mapping_dynamic.yaml "
        "(none: the bundled corpus, packed zigzag_thd delivery; --seq-len and --cache-dir apply to it only)",
    )  # fmt: skip
    parser.add_argument("--tokenizer", default=str(BUNDLED_TOKENIZER_PATH), help="tokenizer path")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per window of the default pipeline")
    parser.add_argument("--cache-dir", help="Arrow cache of the default pipeline (none: Hugging Face's)")
    parser.add_argument(
        "--micro-batch-size", type=int, default=2, help="per DP rank and step (a token budget of this many windows)"
    )
    parser.add_argument("--width", type=int, default=64, help="hidden size")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=1234, help="seeds the weights and the data order")
    parser.add_argument("--save-dir", type=Path, help="where checkpoints go (model, optimizer, data-loader state)")
    parser.add_argument("--save-every", type=int, default=100, help="steps between checkpoints (0: at the end only)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    for name in ("steps", "dp", "cp", "tp", "seq_len", "micro_batch_size", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.save_every < 0:
        parser.error(f"--save-every must be 0 or more, got {args.save_every}")
    if args.resume and args.save_dir is None:
        parser.error("--resume needs --save-dir, the directory to resume from")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run on the ranks torchrun started (``RANK`` and ``WORLD_SIZE`` set), or spawn ``dp * cp * tp`` ranks."""
    args = parse_args(argv)
    if args.resume:
        try:
            latest_checkpoint(args.save_dir, _settings(args))  # before any rank starts
        except (FileNotFoundError, ValueError) as error:
            print(f"train_tiny_gpt.py: error: {error}", file=sys.stderr)
            return 2
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
        try:
            run_rank(args, dist.get_rank(), dist.get_world_size())
        finally:
            dist.destroy_process_group()
        return 0
    world_size = args.dp * args.cp * args.tp
    torch.multiprocessing.spawn(_spawned_rank, args=(world_size, _free_port(), args), nprocs=world_size, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
