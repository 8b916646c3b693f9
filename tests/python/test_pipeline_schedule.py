"""Pipeline schedules held to their theory by the simulator, and their text, pictures and
traces. (The C++ suite checks the same generators in more depth.)"""

from __future__ import annotations

import json
import time

import pytest
import torch

from torch_mp import pipeline

SIZES = [(p, m) for p in (2, 4) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", SIZES)
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, p, m):
    result = pipeline.simulate(pipeline.schedule(name, p, m), forward=1.0, backward=2.0)
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert result.makespan == pytest.approx(3 * (m + p - 1))


@pytest.mark.parametrize("p,m", SIZES)
def test_gpipe_keeps_every_microbatch_and_1f1b_at_most_p(p, m):
    gpipe = pipeline.simulate(pipeline.schedule("gpipe", p, m))
    one_f_one_b = pipeline.simulate(pipeline.schedule("1f1b", p, m))
    assert gpipe.peak_live_microbatches == [m] * p
    assert max(one_f_one_b.peak_live_microbatches) <= p
    assert one_f_one_b.peak_live_microbatches == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize("p,m", SIZES)
def test_interleaving_divides_the_bubble_by_about_stages_per_rank(p, m):
    v = 2
    interleaved = pipeline.simulate(pipeline.schedule("interleaved_1f1b", p * v, m, v))
    one_f_one_b = pipeline.simulate(pipeline.schedule("1f1b", p, m))
    # Megatron's interleaved bubble: (p - 1) / (v m + p - 1), against 1F1B's (p - 1) / (m + p - 1).
    assert interleaved.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert one_f_one_b.bubble_fraction / interleaved.bubble_fraction > 0.75 * v


@pytest.mark.parametrize("p,m", SIZES)
def test_zb_h1_bubble_is_below_1f1b_with_equal_f_b_w(p, m):
    costs = {"forward": 1.0, "backward": 1.0, "weight": 1.0}
    zb = pipeline.simulate(pipeline.schedule("zb_h1", p, m), **costs)
    one_f_one_b = pipeline.simulate(pipeline.schedule("1f1b", p, m), **costs)
    assert zb.bubble_fraction < one_f_one_b.bubble_fraction
    assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
    assert max(zb.peak_live_microbatches) <= p


def test_text_form_round_trips(tmp_path):
    for name, stages, per_rank in [("1f1b", 4, 1), ("interleaved_1f1b", 4, 2), ("zb_h1", 3, 1)]:
        original = pipeline.schedule(name, stages, 4, per_rank)
        path = tmp_path / f"{name}.txt"
        path.write_text(str(original))
        loaded = pipeline.load_schedule(path)
        assert loaded.actions == original.actions
        assert (
            loaded.name,
            loaded.num_stages,
            loaded.num_microbatches,
            loaded.stages_per_rank,
        ) == (name, stages, 4, per_rank)


def test_a_receive_without_a_send_is_rejected_with_its_place():
    text = str(pipeline.schedule("1f1b", 2, 2)).replace(" SEND_F(0,1)", "")
    with pytest.raises(
        RuntimeError,
        match=r"rank 1, step \d+, RECV_F\(1,1\): a receive with no "
        r"matching send \(SEND_F\(0,1\) on rank 0 is missing\)",
    ):
        pipeline.simulate(pipeline.load_schedule(text))


def test_a_deadlock_is_rejected_naming_every_waiting_rank():
    text = """
    rank 0: RECV_B(0,0) F(0,0) SEND_F(0,0) BW(0,0)
    rank 1: RECV_F(1,0) F(1,0) BW(1,0) SEND_B(1,0)
    """
    with pytest.raises(
        RuntimeError,
        match=r"deadlocks(.|\n)*rank 0, step 0, RECV_B\(0,0\)"
        r"(.|\n)*rank 1, step 0, RECV_F\(1,0\)",
    ):
        pipeline.simulate(pipeline.load_schedule(text))


def test_unknown_schedule_and_bad_sizes_raise():
    with pytest.raises(RuntimeError, match="unknown schedule 'pipedream'"):
        pipeline.schedule("pipedream", 2, 2)
    with pytest.raises(RuntimeError, match="needs stages_per_rank >= 2"):
        pipeline.schedule("interleaved_1f1b", 4, 4)
    with pytest.raises(RuntimeError, match="divisible by the number of pipeline ranks"):
        pipeline.schedule("interleaved_1f1b", 4, 3, stages_per_rank=2)


def test_render_writes_svg_and_png(tmp_path):
    s = pipeline.schedule("zb_h1", 4, 8)
    pipeline.render(s, tmp_path / "t.svg")
    pipeline.render(pipeline.simulate(s, 1.0, 1.0, 1.0), tmp_path / "t.png")
    svg = (tmp_path / "t.svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "rank 3" in svg
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match=r"\.svg or \.png"):
        pipeline.render(s, tmp_path / "t.pdf")


def test_chrome_trace_has_one_event_per_action(tmp_path):
    s = pipeline.schedule("1f1b", 2, 4)
    pipeline.chrome_trace(s, tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    actions = sum(len(a) for a in s.actions)
    assert len([e for e in events if e["ph"] in ("X", "i")]) == actions
    forward = next(e for e in events if e["name"] == "F(1,0)")
    assert forward["tid"] == 1 and forward["dur"] == pytest.approx(1e6)


def _model() -> torch.nn.Sequential:
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(4, 4),  # 20 parameters
        torch.nn.ReLU(),
        torch.nn.Linear(4, 16),  # 80
        torch.nn.Linear(16, 4),  # 68
        torch.nn.Linear(4, 4),  # 20
    )


def test_partition_by_params_minimises_the_largest_stage():
    model = _model()
    stages = pipeline.partition(model, 2)
    # Cuts of 5 layers into 2: the best largest stage is 100 (20+0+80 | 68+20 = 88).
    assert [len(s) for s in stages] == [3, 2]
    assert stages[0][0] is model[0] and list(stages[1]._modules) == ["3", "4"]


def test_partition_with_explicit_sizes_and_bad_input():
    model = _model()
    assert [len(s) for s in pipeline.partition(model, 3, balance=[1, 1, 3])] == [1, 1, 3]
    with pytest.raises(ValueError, match="adding up to the 5 layers"):
        pipeline.partition(model, 2, balance=[1, 1])
    with pytest.raises(RuntimeError, match="cannot cut 5 layers into 6"):
        pipeline.partition(model, 6)
    with pytest.raises(ValueError, match="needs sample_input"):
        pipeline.partition(model, 2, balance="time")


class _Slow(torch.nn.Module):
    """Costs 20 ms forward and has no parameters: invisible to "params", dominant for "time"."""

    def forward(self, x):
        time.sleep(0.02)
        return x


def test_partition_by_time_isolates_the_slow_layer():
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), _Slow(), torch.nn.Linear(4, 4)
    )
    stages = pipeline.partition(model, 3, balance="time", sample_input=torch.randn(8, 4))
    # The slow layer outweighs all others together, so the best cut gives it a stage of its own.
    assert [list(s._modules) for s in stages] == [["0", "1"], ["2"], ["3"]]
    assert all(p.grad is None for p in model.parameters())  # profiling leaves no gradients


# ---- NCCL semantics ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_generated_schedules_run_under_nccl_when_grouped(name, p, m):
    schedule = pipeline.schedule(name, p, m)
    nccl = pipeline.simulate(schedule, comm_semantics="nccl")
    assert nccl.makespan == pipeline.simulate(schedule).makespan


def test_interleaved_runs_under_nccl_when_grouped_at_four_ranks():
    pipeline.simulate(pipeline.schedule("interleaved_1f1b", 8, 8, 2), comm_semantics="nccl")


@pytest.mark.parametrize("m", [4, 8, 16])
def test_make_nccl_safe_mends_interleaved_on_two_ranks(m):
    schedule = pipeline.schedule("interleaved_1f1b", 4, m, 2)
    with pytest.raises(RuntimeError, match="deadlocks under NCCL"):
        pipeline.simulate(schedule, comm_semantics="nccl")
    safe = pipeline.make_nccl_safe(schedule)
    assert str(safe) != str(schedule)
    gloo = pipeline.simulate(schedule).makespan
    assert pipeline.simulate(safe, comm_semantics="nccl").makespan == pytest.approx(gloo)
    # With a latency, a send that waits for its receive costs a little.
    costs = {"forward": 1.0, "backward": 2.0, "comm": 0.1}
    slower = pipeline.simulate(safe, comm_semantics="nccl", **costs).makespan
    assert slower <= 1.05 * pipeline.simulate(schedule, **costs).makespan


@pytest.mark.parametrize(
    "name,spr",
    [
        ("gpipe", 1),
        ("1f1b", 1),
        ("zb_h1", 1),
        ("interleaved_1f1b", 2),
        ("interleaved_zb", 2),
        ("zbv", 2),
    ],
)
@pytest.mark.parametrize("p", [2, 4])
def test_every_generated_schedule_is_nccl_safe_after_make_nccl_safe(name, spr, p):
    m = 2 * p
    safe = pipeline.make_nccl_safe(pipeline.schedule(name, p * spr, m, spr))
    pipeline.simulate(safe, comm_semantics="nccl")


def test_one_at_a_time_sends_deadlock_1f1b_under_nccl():
    # Both neighbours send first in the steady state; under NCCL each send waits for a receive
    # that sits behind the other rank's send on the same stream.
    schedule = pipeline.schedule("1f1b", 2, 4)
    pipeline.simulate(schedule)  # Gloo buffers the sends
    with pytest.raises(RuntimeError, match="deadlocks under NCCL") as error:
        pipeline.simulate(schedule, comm_semantics="nccl_ungrouped")
    assert "NCCL stream rank 0 -> rank 1 is held at" in str(error.value)


def test_messages_received_out_of_order_are_refused_under_nccl():
    # By tag (Gloo) each receive gets its own message; NCCL ignores tags and pairs them in order.
    schedule = pipeline.load_schedule(
        "# torch_mp schedule mine: num_stages=2 num_microbatches=2 stages_per_rank=1\n"
        "rank 0: F(0,0) SEND_F(0,0) F(0,1) SEND_F(0,1) RECV_B(0,0) BW(0,0) RECV_B(0,1) BW(0,1)\n"
        "rank 1: RECV_F(1,1) RECV_F(1,0) F(1,0) BW(1,0) SEND_B(1,0) F(1,1) BW(1,1) SEND_B(1,1)\n"
    )
    pipeline.simulate(schedule)
    misrouted = r"SEND_F\(0,0\) .* would land in rank 1's RECV_F\(1,1\)"
    with pytest.raises(RuntimeError, match=misrouted):
        pipeline.simulate(schedule, comm_semantics="nccl")


def test_zbv_messages_between_two_ranks_are_reordered_for_nccl():
    # Rank 0 sends stage 0's activations and stage 3's gradients to rank 1, which would receive
    # them in another order: the receive each message is meant for moves ahead.
    schedule = pipeline.schedule("zbv", 4, 4, 2)
    with pytest.raises(RuntimeError, match="would land in rank 1's"):
        pipeline.simulate(schedule, comm_semantics="nccl")
    safe = pipeline.make_nccl_safe(schedule)
    # Two receives from rank 0 in a row: under NCCL the second is posted once the first is
    # finished (p2p_groups, so that a message's follow-ups stay next in line), which costs rank 1
    # one forward's time here.
    gloo = pipeline.simulate(schedule).makespan
    assert gloo <= pipeline.simulate(safe, comm_semantics="nccl").makespan <= gloo + 1


@pytest.mark.parametrize("p", [1, 2, 4])
def test_zbv_matches_the_published_zero_bubble_v(p):
    m = 4 * p
    schedule = pipeline.schedule("zbv", 2 * p, m, 2)
    assert schedule.placement == "v"
    assert schedule.stages_of_rank(0) == [0, 2 * p - 1]
    result = pipeline.simulate(schedule, forward=1.0, backward=1.0, weight=1.0)
    assert result.makespan == 6 * m + p - 1  # only the last rank's start-up wait
    assert max(result.peak_live_microbatches) == 2 * p  # 1F1B's p micro-batches of a rank
    again = pipeline.load_schedule(str(schedule))
    assert again.placement == "v" and again.actions == schedule.actions
