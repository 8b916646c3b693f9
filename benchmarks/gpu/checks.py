"""The Python part of benchmarks/gpu/check.sh: NCCL checks and the GPU table.

    python benchmarks/gpu/checks.py                      # one process (world size 1)
    torchrun --nproc-per-node=2 benchmarks/gpu/checks.py --nccl-only

Checks (each prints OK or FAILED with the largest difference; the exit status is non-zero if any
failed), over NCCL on CUDA tensors, fp32 without TF32, against the same model on one device:

- a ColumnParallelLinear -> GELU -> RowParallelLinear MLP and a ParallelTransformerLayer at tp =
  world (outputs and input gradients, 1e-5);
- the pipeline at pp = world, every schedule (loss and every parameter gradient, 1e-5);
- context-parallel attention at cp = world, every method, causal and load-balanced (output and
  q/k/v gradients against SDPA on the whole sequence, 1e-5);
- the MoE layer at ep = world (output, 1e-5);
- one process only: the fused cross-entropy kernels against the CPU path (loss and gradients;
  fp32 1e-5, bf16 1e-2).

Then, at world size 1, the table: a GPT block (pre-LN transformer layer, hidden 4096, 32 heads,
ffn 16384, [s=2048, b=4], bf16, forward + backward) through torch_mp at tp = 1 against
``nn.TransformerEncoderLayer``, with TFLOP/s and MFU against the H200's 989 dense bf16 TFLOP/s;
``vocab_parallel_cross_entropy`` against ``F.cross_entropy`` (8192 rows x 128256 classes, bf16,
forward + backward): time and peak memory. Median of 20 timed steps after 5, CUDA events; FLOPs
counted as 6 x parameters x tokens + attention's 12 x b x s^2 x h per layer (forward and
backward, causal half not discounted). With ``--out DIR`` the table is also written to
``DIR/table.md``.

Without a CUDA device it says so and exits 0.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import torch_mp  # noqa: E402

failures: list[str] = []
# The backend of the checks' groups (Gloo with --cpu).
BACKEND = "nccl"
# The H200's dense bf16 peak (NVIDIA's figure, without sparsity), for MFU.
PEAK_TFLOPS = 989


def report(name: str, difference: float, tolerance: float) -> None:
    ok = difference <= tolerance
    if not ok:
        failures.append(name)
    if dist.get_rank() == 0:
        print(
            f"{'OK' if ok else 'FAILED'}: {name} ({BACKEND}, world {dist.get_world_size()}): "
            f"max |diff| {difference:.2e} (<= {tolerance:.0e})"
        )


def worst(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def check_layers(device: torch.device) -> None:
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).to(device)
    mlp = nn.Sequential(
        torch_mp.ColumnParallelLinear.from_dense(dense[0]),
        nn.GELU(),
        torch_mp.RowParallelLinear.from_dense(dense[2]),
    )
    x = torch.randn(64, 256, device=device, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    dense(x).square().sum().backward()
    out = mlp(y)
    out.square().sum().backward()
    report("MLP output", worst(out, dense(x)), 1e-5)
    report("MLP input gradient", worst(y.grad, x.grad), 1e-5)

    layer = nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.0, norm_first=True).to(device)
    parallel = torch_mp.ParallelTransformerLayer.from_dense(layer)
    x = torch.randn(32, 4, 256, device=device)
    report("transformer layer", worst(parallel(x, is_causal=True),
                                                layer(x, src_mask=causal(32, device),
                                                      is_causal=True)), 1e-5)  # fmt: skip


def causal(s: int, device) -> torch.Tensor:
    return nn.Transformer.generate_square_subsequent_mask(s, device=device)


def check_cross_entropy(device: torch.device) -> None:
    if not torch_mp._C.has_fused_cuda_kernels():
        failures.append("fused kernels not built")
        print("FAILED: torch has CUDA but torch_mp was built without the fused kernels")
        return
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        torch.manual_seed(1)
        logits = (torch.randn(512, 1001) * 4).to(dtype)
        target = torch.randint(0, 1001, (512,))
        target[::7] = -100
        results = []
        for where in ("cpu", device):
            x = logits.to(where).requires_grad_()
            loss = torch_mp.vocab_parallel_cross_entropy(x, target.to(where), label_smoothing=0.1)
            loss.backward()
            results.append((loss.detach().cpu(), x.grad.cpu()))
        (cpu_loss, cpu_grad), (cuda_loss, cuda_grad) = results
        report(f"fused cross-entropy {dtype}: loss", worst(cuda_loss, cpu_loss), tolerance)
        report(f"fused cross-entropy {dtype}: gradient", worst(cuda_grad, cpu_grad), tolerance)


def check_pipeline(device: torch.device, world: int) -> None:
    mesh = torch_mp.init(pp=world, backend=BACKEND)
    rank = dist.get_rank()
    for name, spr in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1),
                      ("interleaved_zb", 2), ("zbv", 2)):  # fmt: skip
        torch.manual_seed(0)
        stages = [nn.Sequential(nn.Linear(64, 64), nn.Tanh()).to(device)
                  for _ in range(world * spr)]  # fmt: skip
        reference = nn.Sequential(*[copy.deepcopy(s) for s in stages])
        m = 2 * world * spr
        x = torch.randn(4 * m, 64, device=device)
        y = torch.randn(4 * m, 64, device=device)
        F.mse_loss(reference(x), y).backward()
        schedule = torch_mp.pipeline.schedule(name, world * spr, m, spr)
        indices = schedule.stages_of_rank(rank)
        mine = [stages[i] for i in indices]
        pipe = torch_mp.pipeline.Pipeline(mine, schedule, loss_fn=F.mse_loss, mesh=mesh)
        pipe.step(x if 0 in indices else None, target=y if len(stages) - 1 in indices else None)
        difference = max(worst(p.grad, r.grad) for i, stage in zip(indices, mine, strict=True)
                         for p, r in zip(stage.parameters(), reference[i].parameters(),
                                         strict=True))  # fmt: skip
        report(f"pipeline, {name}: gradients", difference, 1e-5)


def check_context_parallel(device: torch.device, world: int) -> None:
    torch_mp.init(cp=world, backend=BACKEND)
    cp = torch_mp.context_parallel
    torch.manual_seed(3)
    q, k, v, g = (torch.randn(2, 4, 16 * world, 32, device=device) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*leaves, is_causal=True)
    expected.backward(g)

    def part(t):
        return cp.shard_sequence(t, 2, load_balance=True)

    for method in cp.METHODS:
        mine = [part(t).detach().requires_grad_() for t in (q, k, v)]
        out = cp.attention(*mine, is_causal=True, method=method, load_balance=True)
        out.backward(part(g))
        difference = max([worst(out, part(expected))] + [worst(t.grad, part(w.grad))
                         for t, w in zip(mine, leaves, strict=True)])  # fmt: skip
        report(f"context-parallel attention, {method}", difference, 1e-5)


def check_moe(device: torch.device, world: int) -> None:
    torch_mp.init(ep=world, dp=world, backend=BACKEND)
    torch.manual_seed(4)
    reference = torch_mp.dense.MoE(64, 128, 4 * world, top_k=2).to(device)
    parallel = torch_mp.moe.MoE.from_dense(reference)
    x = torch.randn(2, 8, 64, device=device)
    y, _ = parallel(x)
    want, _ = reference(x)
    report("MoE output", worst(y, want), 1e-5)


def cuda_time(fn, steps: int = 20, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def table(device: torch.device) -> list[str]:
    h, heads, ffn, s, b = 4096, 32, 16384, 2048, 4
    torch.manual_seed(2)
    dense = nn.TransformerEncoderLayer(h, heads, ffn, dropout=0.0, norm_first=True,
                                       activation="gelu").to(device, torch.bfloat16)  # fmt: skip
    ours = torch_mp.ParallelTransformerLayer.from_dense(dense)
    x = torch.randn(s, b, h, device=device, dtype=torch.bfloat16, requires_grad=True)
    mask = causal(s, device).to(torch.bfloat16)
    params = sum(p.numel() for p in dense.parameters())
    flops = 6 * params * s * b + 12 * b * s * s * h

    def step(module, **kwargs):
        def run():
            module(x, **kwargs).float().square().mean().backward()

        return run

    rows = []
    t_dense = cuda_time(step(dense, src_mask=mask, is_causal=True))
    t_ours = cuda_time(step(ours, is_causal=True))
    rows.append(("GPT block fwd+bwd (torch_mp tp=1 / nn.TransformerEncoderLayer)", t_ours, t_dense,
                 flops))  # fmt: skip
    logits = torch.randn(8192, 128256, device=device, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 128256, (8192,), device=device)

    def ours_ce():
        torch_mp.vocab_parallel_cross_entropy(logits, target).backward()

    def torch_ce():
        F.cross_entropy(logits, target).backward()

    rows.append(("cross-entropy fwd+bwd (vocab_parallel / F.cross_entropy)", cuda_time(ours_ce),
                 cuda_time(torch_ce), None))  # fmt: skip
    peaks = [peak_memory(fn) for fn in (ours_ce, torch_ce)]
    lines = [
        f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, bf16",
        "",
        "| case | torch_mp ms | PyTorch ms | torch_mp / PyTorch | torch_mp TFLOP/s | MFU |",
        "|---|---|---|---|---|---|",
    ]
    for name, ours_s, theirs_s, n in rows:
        rate = n / ours_s / 1e12 if n else None
        speed = f"{rate:.0f} | {rate / PEAK_TFLOPS:.0%}" if rate else "- | -"
        times = f"{ours_s * 1e3:.2f} | {theirs_s * 1e3:.2f} | {ours_s / theirs_s:.2f}"
        lines.append(f"| {name} | {times} | {speed} |")
    lines.append("")
    mib = [f"{peak / 2**20:.0f} MiB" for peak in peaks]
    lines.append(
        "cross-entropy peak memory above the logits and their gradient: "
        f"torch_mp {mib[0]}, F.cross_entropy {mib[1]}"
    )
    return lines


def peak_memory(fn) -> int:
    """Bytes `fn` allocates at its peak beyond what was allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nccl-only", action="store_true", help="only the NCCL exactness checks")
    parser.add_argument("--out", default=None, help="a folder to write the table to (table.md)")
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="the exactness checks on the CPU over Gloo, without the kernels and the table "
        "(what a machine without a GPU can run of this script)",
    )
    args = parser.parse_args()
    global BACKEND
    if args.cpu:
        BACKEND = "gloo"
    elif not torch.cuda.is_available():
        print("skipped: no CUDA device here (the GPU checks and the table need one; --cpu runs "
              "the exactness checks over Gloo)")  # fmt: skip
        return 0
    if "RANK" not in os.environ:  # one process: a world of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29581", RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")  # fmt: skip
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    world = int(os.environ["WORLD_SIZE"])
    torch_mp.init(tp=world, backend=BACKEND)
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    for check in (check_layers, check_pipeline, check_context_parallel, check_moe):
        try:
            check(device) if check is check_layers else check(device, world)
        except Exception as e:  # one failing check must not hide the others
            failures.append(check.__name__)
            if dist.get_rank() == 0:
                print(f"FAILED: {check.__name__}: {type(e).__name__}: {e}")
    if args.cpu:
        if dist.get_rank() == 0:
            print("skipped on the CPU: the fused CUDA kernels and the table")
    elif not args.nccl_only:
        check_cross_entropy(device)
        if world == 1:
            lines = table(device)
            print("\n" + "\n".join(lines))
            if args.out:
                with open(os.path.join(args.out, "table.md"), "w") as f:
                    f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
