"""The benchmark scripts still drive the library the way it is driven today.

They are not run by the suite (each takes minutes to hours), so a library change can leave one
broken without a failing test: step_cost's fixed batch stopped working for fdp, fpdp and maskdp
when their public-view gradient moved to a public sample of its own (2026-11-27). This runs the
step the script times, for every mechanism, at a small size.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest
import torch

from fedpose.privacy.engine import build_engine

STEP_COST = Path(__file__).resolve().parents[1] / "benchmarks" / "step_cost" / "run.py"


def _load_step_cost():
    spec = importlib.util.spec_from_file_location("step_cost_run", STEP_COST)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_cost_times_one_step_of_every_mechanism():
    step_cost = _load_step_cost()
    args = argparse.Namespace(backbone="tiny_vit_test", size=(128, 96), device=torch.device("cpu"))
    model = step_cost.make_model(args)
    batch_size = 2
    private = step_cost.RandomPoseSet(4 * batch_size, args.size)
    public = step_cost.RandomPoseSet(4, args.size, 10_000)
    for name in step_cost.MECHANISMS:
        engine = build_engine(step_cost.privacy_config(name, 2, 4), model, len(private), batch_size, 10, public, 0)
        batch = step_cost.fixed_batch(engine, private, batch_size)
        metrics, seconds, _ = step_cost.timed_step(engine, model, batch, args.device)
        assert seconds > 0, name
        assert metrics["batch_size"] == batch_size, name


@pytest.mark.parametrize("mechanism", ["fdp", "fpdp", "maskdp"])
def test_step_cost_gives_a_public_view_mechanism_a_public_sample_apart_from_the_private_rows(mechanism):
    step_cost = _load_step_cost()
    args = argparse.Namespace(backbone="tiny_vit_test", size=(128, 96), device=torch.device("cpu"))
    model = step_cost.make_model(args)
    private = step_cost.RandomPoseSet(8, args.size)
    engine = build_engine(step_cost.privacy_config(mechanism, 2, 4), model, len(private), 2, 10,
                          step_cost.RandomPoseSet(4, args.size, 10_000), 0)
    batch = step_cost.fixed_batch(engine, private, 2)
    public_sample = batch[step_cost.PUBLIC_SAMPLE_KEY]
    assert set(public_sample["index"].tolist()).isdisjoint(batch["index"].tolist())
