"""``python -m torch_mp.checkpoint verify PATH [PATH ...]``: checks checkpoints (directories
or dense safetensors files) against the CRC-32C saved with every block, without loading them
into a model, and lists every corrupt block. Exits 1 if any is corrupt, else 2 if files
without checksums (which cannot be verified) were found, else 0."""

from __future__ import annotations

import argparse
import sys

from torch_mp import _C


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_mp.checkpoint", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    verify = commands.add_parser("verify", help="check checkpoints against their checksums")
    verify.add_argument("paths", nargs="+", metavar="PATH")
    verify.add_argument(
        "--threads", type=int, default=0, help="files read at once (0: a core each)"
    )
    args = parser.parse_args(argv)
    corrupt = unverified = 0
    for path in args.paths:
        try:
            report = _C.checkpoint.verify(path, args.threads)
        except RuntimeError as e:
            print(f"{path}: {e}", file=sys.stderr)
            corrupt += 1
            continue
        for block in report.corrupt:
            print(block.message)
        for file in report.unchecked:
            print(f"{path}: {file} records no checksums, or not all: it cannot be verified")
        if report.corrupt:
            state = f"{len(report.corrupt)} corrupt"
        elif report.unchecked:
            state = f"{len(report.unchecked)} files cannot be verified (no checksums)"
        else:
            state = "intact"
        print(
            f"{path}: {report.blocks} blocks in {report.files} files "
            f"({report.bytes / 1e6:.1f} MB) read: {state}"
        )
        corrupt += len(report.corrupt)
        unverified += len(report.unchecked)
    return 1 if corrupt else 2 if unverified else 0


if __name__ == "__main__":
    sys.exit(main())
