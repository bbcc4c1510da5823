"""``scheduled_provenance`` against a packing scheduler's real delivery on gloo ranks: every traced sequence's
tokens, read back by tokenizing its JSON line again, are the tokens of that rank's packed micro-batch at its span."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from tools.test_provenance import _jsonl, _online_config

from hyper_parallel.data.batching.dataloader import build_dataloaders
from hyper_parallel.data.errors import DataConfigError
from hyper_parallel.data.tools.cli import main as hp_data
from hyper_parallel.data.tools.provenance import scheduled_provenance
from parallel.launch import launch

STEPS, NUM_MICRO_BATCHES = 2, 2


def _scheduled_config(tmp_path, scheduler: str):
    path, lines = _jsonl(tmp_path)
    config = _online_config(path, tmp_path)
    config["packing_scheduler"] = {
        "_target_": "hyper_parallel.data.parallel.data_schedule_utils.PackingSchedulerConfig",
        "max_seqlen_per_dp_cp_rank": 256,
        "scheduler": scheduler,
    }
    return config, lines


def delivered_steps(rank: int, world_size: int, *, config: dict, shape: tuple[int, int]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from hyper_parallel.data.parallel.process_groups import ProcessGroupCollection
    from hyper_parallel.data.text.build_tokenizer import BUNDLED_TOKENIZER_PATH

    groups = ProcessGroupCollection.from_mesh(init_device_mesh("cpu", shape, mesh_dim_names=("dp", "cp")))
    loaders = build_dataloaders(
        config, tokenizer=str(BUNDLED_TOKENIZER_PATH), pg_collection=groups, train_valid_test_num_samples=[None, 0, 0]
    )
    iterator = iter(loaders.train)
    steps = []
    for _ in range(STEPS):
        step = loaders.get_batch.schedule(iterator, NUM_MICRO_BATCHES)
        steps.append([batch.input_ids[0].tolist() for batch in step.micro_batches])
    return {"position": groups.position, "steps": steps}


@pytest.mark.parametrize(("shape", "scheduler"), [((2, 1), "dp_balanced"), ((1, 2), "compute_balanced")])
def test_every_rank_of_the_domain_gets_the_traced_tokens(tmp_path, tokenizer, shape, scheduler):
    config, lines = _scheduled_config(tmp_path, scheduler)
    reports = launch(functools.partial(delivered_steps, config=config, shape=shape), tmp_path, world_size=2)
    assert [report.get("error") for report in reports] == [None, None]
    transform = build_dataloaders(config, tokenizer=tokenizer, train_valid_test_num_samples=[None, 0, 0]).datasets[0]
    transform = transform.transform
    traced_tokens = 0
    for report in reports:
        rank = report["value"]["position"]
        for step, delivered in enumerate(report["value"]["steps"]):
            traced = scheduled_provenance(
                config,
                step=step,
                num_micro_batches=NUM_MICRO_BATCHES,
                rank=rank,
                dp_size=shape[0],
                cp_size=shape[1],
                tokenizer=tokenizer,
            )
            assert len(traced) == len(delivered)
            for sequences, row in zip(traced, delivered, strict=True):
                for sequence in sequences:
                    tokens = np.concatenate([window["input_ids"] for window in transform(lines[sequence.record])])
                    start, end = sequence.tokens
                    assert row[sequence.span[0] : sequence.span[1]] == tokens[start:end].tolist()
                    traced_tokens += end - start
    assert traced_tokens > 0


def test_a_config_without_a_scheduler_and_a_bad_rank_are_refused(tmp_path, tokenizer):
    config, _ = _scheduled_config(tmp_path, "dp_balanced")
    with pytest.raises(DataConfigError, match="the DP x CP domain of 2 x 2 holds ranks 0 to 3"):
        scheduled_provenance(config, step=0, num_micro_batches=2, rank=4, dp_size=2, cp_size=2, tokenizer=tokenizer)
    del config["packing_scheduler"]
    with pytest.raises(DataConfigError, match="the config has no packing_scheduler node"):
        scheduled_provenance(config, step=0, num_micro_batches=2, rank=0, tokenizer=tokenizer)


def test_the_command_traces_a_scheduled_rank(tmp_path, tokenizer, tokenizer_path, capsys):
    config, _ = _scheduled_config(tmp_path, "compute_balanced")
    path = tmp_path / "pipeline.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    command = ["provenance", str(path), "--tokenizer", str(tokenizer_path), "--step", "1", "--num-micro-batches", "2"]
    assert hp_data([*command, "--rank", "1", "--cp-size", "2", "--json"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected = scheduled_provenance(config, step=1, num_micro_batches=2, rank=1, cp_size=2, tokenizer=tokenizer)
    assert printed == [json.loads(json.dumps(s.as_dict())) for sequences in expected for s in sequences]
    assert hp_data([*command, "--rank", "1", "--cp-size", "2", "--dp-rank", "1"]) == 2
    assert "without --batch, --dp-rank or --state" in capsys.readouterr().err
