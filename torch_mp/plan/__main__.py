"""``python -m torch_mp.plan``: the fastest layouts of a model on a cluster, before launch.

    python -m torch_mp.plan --model llama-8b --world 64 --memory 80GB --seq 8192 \\
        --global-batch 512 [--machine h100]

prints the best layouts (:func:`torch_mp.plan.search`) as a table and the command that runs the
best with examples/python/gpt_3d.py (a GPT) or examples/python/llama.py (a Hugging Face
decoder)."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

from torch_mp.plan.machine import Machine
from torch_mp.plan.search import NothingFits, search


def named_models() -> dict:
    """The models ``--model`` knows by name (their published sizes)."""
    import transformers

    from torch_mp.models import GPTConfig

    return {
        "llama-8b": transformers.LlamaConfig(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            rope_theta=500000.0,
        ),
        "llama-70b": transformers.LlamaConfig(
            vocab_size=128256,
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            rope_theta=500000.0,
        ),
        "gpt2-xl": GPTConfig(vocab=50257, seq=1024, hidden=1600, heads=25, ffn=6400, layers=48),
        "mixtral-8x7b": transformers.MixtralConfig(),
        # Mixtral's sizes in the GPT of torch_mp.models (gelu experts, learned positions), which
        # gpt_3d.py trains with pipelines and expert groups
        "gpt-moe-8x7b": GPTConfig(
            vocab=32000,
            seq=32768,
            hidden=4096,
            heads=32,
            ffn=14336,
            layers=32,
            moe_experts=8,
            moe_top_k=2,
        ),
    }


def load_model(name: str):
    """A named model, or a JSON file: a Hugging Face config (it has ``model_type``) or a
    GPTConfig's fields."""
    models = named_models()
    if name in models:
        return models[name]
    path = pathlib.Path(name)
    if not path.is_file():
        raise SystemExit(
            f"python -m torch_mp.plan: --model is one of {', '.join(models)} or a config.json; "
            f"no file {name!r}"
        )
    fields = json.loads(path.read_text())
    if "model_type" in fields:
        import transformers

        return transformers.AutoConfig.for_model(**fields)
    from torch_mp.models import GPTConfig

    return GPTConfig(**fields)


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f}"


def table(candidates, machine: Machine, world: int) -> str:
    lines = [
        "| # | layout | peak GB | step s | tokens/s | tokens/s/device | bubble | HFU |",
        "|--:|---|--:|--:|--:|--:|--:|--:|",
    ]
    for i, c in enumerate(candidates, 1):
        t = c.estimate.time
        flops = machine.flops_at(c.layout.dtype)
        hfu = c.estimate.flops_per_rank / (t.seconds * flops)  # (recomputation counted)
        lines.append(
            f"| {i} | {c.describe()} | {_gb(c.peak)} | {t.seconds:.3f} | "
            f"{t.tokens_per_second:,.0f} | {t.tokens_per_second / world:,.0f} | "
            f"{t.bubble_fraction:.2f} | {100 * hfu:.0f} % |"
        )
    return "\n".join(lines)


def command(candidate, model, world: int, machine: Machine) -> str:
    """The torchrun command that trains ``model`` at ``candidate``'s layout."""
    k = candidate.keywords
    per_node = machine.gpus_per_node or world
    nodes = max(1, world // per_node)
    launch = f"torchrun --nnodes={nodes} --nproc-per-node={min(per_node, world)}"
    bf16 = k["dtype"].itemsize < 4
    if getattr(model, "model_type", None) == "mixtral":
        args = [f"--tp {k['tp']}", f"--ep {k['ep']}", f"--experts {model.num_local_experts}"]
        args += [f"--top-k {model.num_experts_per_tok}", f"--batch {k['micro_batch']}"]
        args += [f"--seq {k['seq_len']}", f"--hidden {model.hidden_size}"]
        args += [f"--heads {model.num_attention_heads}", f"--ffn {model.intermediate_size}"]
        args += [f"--layers {model.num_hidden_layers}"]
        note = (
            "# mixtral_moe.py trains in fp32 without ZeRO, one micro-batch a step, on its own "
            f"small vocabulary: {k['num_microbatches']} such steps make one of the global batch"
        )
        return f"{note}\n{launch} examples/python/mixtral_moe.py {' '.join(args)}"
    if hasattr(model, "model_type"):
        args = [f"--tp {k['tp']}"]
        args += [f"--zero {k['zero']}"] if k["zero"] and (k["zero"] == 3 or not bf16) else []
        args += ["--bf16"] if bf16 else []
        args += ["--recompute"] if k["recompute"] == "full" else []
        args += [f"--batch {k['micro_batch']}", f"--seq {k['seq_len']}"]
        args += [f"--hidden {model.hidden_size}", f"--heads {model.num_attention_heads}"]
        args += [f"--ffn {model.intermediate_size}", f"--layers {model.num_hidden_layers}"]
        note = (
            "# llama.py trains one micro-batch a step on its own small vocabulary, without "
            f"grouped key and value heads: {k['num_microbatches']} such steps make one of the "
            "global batch"
        )
        return f"{note}\n{launch} examples/python/llama.py {' '.join(args)}"
    args = [f"--tp {k['tp']}", f"--pp {k['pp']}"]
    args += [f"--cp {k['cp']}"] if k.get("cp", 1) > 1 else []
    args += [f"--schedule {k['schedule']}"] if k["pp"] > 1 else []
    args += ["--bf16"] if bf16 else []
    args += [f"--zero {k['zero']}"] if k["zero"] and (k["zero"] == 3 or not bf16) else []
    args += [f"--recompute {k['recompute']}"] if k["recompute"] else []
    args += ["--sequence-parallel"] if k["sequence_parallel"] else []
    args += [f"--batch {k['micro_batch'] * k['num_microbatches']}"]
    args += [f"--microbatches {k['num_microbatches']}", f"--seq {k['seq_len']}"]
    args += [f"--hidden {model.hidden}", f"--heads {model.heads}", f"--ffn {model.ffn}"]
    args += [f"--layers {model.layers}"]
    if model.moe_experts:
        args += [f"--moe-experts {model.moe_experts}", f"--moe-top-k {model.moe_top_k}"]
        args += [f"--ep {k['ep']}"] if k["ep"] > 1 else []
    note = "# gpt_3d.py trains on its own character vocabulary (the estimate's is the model's)"
    return f"{note}\n{launch} examples/python/gpt_3d.py {' '.join(args)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torch_mp.plan", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", required=True, help="llama-8b, gpt2-xl, ... or a config.json")
    parser.add_argument("--world", type=int, required=True, help="devices in all")
    parser.add_argument("--memory", help="each device's, e.g. 80GB (default: the machine's)")
    parser.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    parser.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    parser.add_argument(
        "--machine",
        default="h100",
        help=f"one of {', '.join(Machine.shipped())} or a machine file (JSON)",
    )
    parser.add_argument("--fp32", action="store_true", help="train in fp32 (default: bf16)")
    parser.add_argument("--top", type=int, default=10, help="layouts to show")
    args = parser.parse_args(argv)
    model = load_model(args.model)
    machine = Machine.load(args.machine)
    try:
        best = search(
            model,
            world=args.world,
            memory=args.memory,
            seq_len=args.seq,
            global_batch=args.global_batch,
            machine=machine,
            dtype=torch.float32 if args.fp32 else torch.bfloat16,
            top=args.top,
        )
    except (NothingFits, TypeError, ValueError) as error:
        print(f"python -m torch_mp.plan: {error}", file=sys.stderr)
        return 1
    print(
        f"{args.model} on {args.world} x {machine.name or args.machine}, sequences of "
        f"{args.seq}, {args.global_batch} a step\n"
    )
    print(table(best, machine, args.world))
    print("\n(HFU: the busiest rank's FLOPs, recomputation included, over the step at peak FLOP/s)")
    print(f"\nthe best:\n{command(best[0], model, args.world, machine)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
