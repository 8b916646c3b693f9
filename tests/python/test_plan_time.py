"""The step-time estimate from Python (torch_mp.plan.Machine, estimate(..., machine=...),
measure_time): machine files, where each dimension's link comes from, probes that measure
the ranks, and refusals. Its ranking of measured layouts is benchmarks/plan_time.py's."""

from __future__ import annotations

import pytest
import torch
from reference import use_mesh

from torch_mp import plan
from torch_mp.models import GPTConfig
from torch_mp.plan.validation import CONFIG

SMALL = {"micro_batch": 2, "seq_len": 64}
GPT = GPTConfig(vocab=50304, seq=2048, hidden=2048, heads=16, ffn=8192, layers=24)
BIG = {"dtype": torch.bfloat16, "micro_batch": 1, "seq_len": 2048}


def test_machine_files_ship_with_their_public_figures():
    assert {"h100", "h200"} <= set(plan.Machine.shipped())
    h100, h200 = plan.Machine.load("h100"), plan.Machine.load("h200")
    assert h100.flops_at(torch.bfloat16) == 989e12 and h100.memory == 80 * 10**9
    assert h200.memory == 141 * 10**9 and h200.memory_bandwidth > h100.memory_bandwidth
    with pytest.raises(FileNotFoundError, match="h100, h200"):
        plan.Machine.load("a100-typo")
    with pytest.raises(ValueError, match="no flops for float64"):
        h100.flops_at(torch.float64)


def test_a_group_inside_a_node_gets_the_node_s_links():
    h100 = plan.Machine.load("h100")
    sizes = {"tp": 8, "pp": 4, "dp": 2}
    assert h100.link("tp", sizes) == 450  # ranks 0-7: one node
    assert h100.link("dp", sizes) == 50  # every 8th rank
    assert h100.link("dp", {"tp": 2, "dp": 4}) == 450  # 8 ranks
    assert plan.Machine(links={"dp": 7}, gpus_per_node=8, intra_node=450).link("dp", sizes) == 7


def test_the_step_time_weighs_bubbles_and_traffic():
    e = plan.estimate(GPT, tp=8, pp=4, dp=2, num_microbatches=4, machine="h100", **BIG)
    t = e.time
    assert t.seconds == pytest.approx(t.pipeline + t.data_parallel + t.optimizer)
    assert 0.4 < t.bubble_fraction < 0.5  # (p - 1) / (m + p - 1) = 3/7
    more = plan.estimate(GPT, tp=8, pp=4, dp=2, num_microbatches=32, machine="h100", **BIG).time
    assert more.bubble_fraction < 0.2 and more.tokens_per_second > t.tokens_per_second
    assert t.tokens_per_second == pytest.approx(2 * 4 * 2048 / t.seconds)
    # tp 8 across nodes (4 GPUs a node) sends its all-reduces over the 9 times slower link
    slow = plan.Machine.load("h100")
    slow.gpus_per_node = 4
    e2 = plan.estimate(GPT, tp=8, pp=4, dp=2, num_microbatches=4, machine=slow, **BIG)
    assert e2.time.communication["tp"] > 3 * t.communication["tp"]  # (its latency: the same)
    assert not hasattr(plan.estimate(GPT, tp=8, **BIG), "time")
    # context ranks: their ring's traffic, and the data x context group's gradients
    ring = plan.estimate(GPT, tp=4, cp=2, dp=8, machine="h100", **BIG).time
    assert ring.communication["cp"] > 0 and ring.communication["dp"] > 0


def test_a_missing_figure_is_refused_by_name():
    machine = plan.Machine(flops=1e12, memory_bandwidth=100, links={"tp": 10})
    with pytest.raises(ValueError, match='no link for "dp" \\(dp=2\\)'):
        plan.estimate(CONFIG, tp=2, dp=2, machine=machine, **SMALL)
    with pytest.raises(ValueError, match="flops and memory_bandwidth"):
        plan.estimate(CONFIG, machine=plan.Machine(flops=1e12), **SMALL)


def _probe(world_size: int):
    mesh = use_mesh(1)
    machine = plan.Machine.measure(mesh, size=256, repeats=2)
    seconds = plan.measure_time(CONFIG, dp=world_size, mesh=mesh, steps=1, warmup=1, **SMALL)
    e = plan.estimate(CONFIG, dp=world_size, machine=machine, **SMALL)
    return machine, seconds, e.time.seconds


def test_the_machine_is_measured_on_the_ranks(world):
    results = world.run(_probe, world.size)
    machine, seconds, estimated = results[0]
    assert machine.flops_at(torch.float32) > 1e8 and machine.memory_bandwidth > 0.1
    assert machine.op_overhead > 0
    assert set(machine.links) == ({"dp"} if world.size > 1 else set())
    assert all(r[0] == machine for r in results)  # (every rank: the slowest rank's figures)
    # (no bound on the ratio: on shared cores it is what benchmarks/plan_time.py measures)
    assert seconds > 0 and estimated > 0
