"""The `gcmoe-lab` command: gcmoe's benchmarks, tuner, multi-GPU harness and probes.

gcmoe-lab bench [--models ...] [--tokens ...] [--variants ...] [--iters N] [--json PATH] [--markdown PATH] [--plot PATH]
                                    the layer (partitioned / sequential / eager), torch FP8 and the peers side by
                                    side: interleaved, cold L2, medians, next to the FP4 floor (gcmoe_lab.bench)
gcmoe-lab tune [--two-batch [--layers N]] [--models ...] [--tokens ...] [--comm-sizes ...] [--out DIR]
                                    measure and cache the comm partition size per shape, one-batch calls or
                                    (--two-batch) two micro-batches of an N-layer step (gcmoe_lab.tune)
gcmoe-lab multigpu check|bench|dispatch [--ranks P] ...
                                    the layer across GPUs, one process per GPU (gcmoe_lab.multigpu)
gcmoe-lab probe [NAME [ARGS]]       list the probes, or run one (gcmoe_lab.probes)

`gcmoe bench` and `gcmoe tune` (the product's CLI) hand their arguments to `gcmoe-lab bench` / `gcmoe-lab tune`.
Each command parses its own arguments: `gcmoe-lab COMMAND --help`.
"""

from __future__ import annotations

import argparse
import sys

COMMANDS = {
    "bench": "the layer, torch FP8 and the peers side by side over model shapes and token counts",
    "tune": "measure the comm partition size per model shape on this GPU; cache the policy, write the table",
    "multigpu": "the layer across GPUs: bit-exact checks, benches, dispatch vs NCCL",
    "probe": "list the probes, or run one: probe NAME [ARGS]",
}


def run(command: str, args: list[str], prog: str | None = None) -> int:
    """Run one command with its arguments (prog: the name its usage shows, e.g. `gcmoe bench`)."""
    prog = prog or f"gcmoe-lab {command}"
    if command == "bench":
        from . import bench

        return bench.main(args, prog)
    if command == "tune":
        from . import tune

        return tune.main(args, prog)
    if command == "multigpu":
        from . import multigpu

        return multigpu.main(args)
    if command == "probe":
        return probe(args)
    raise ValueError(f"unknown command {command!r}; commands: {', '.join(COMMANDS)}")


def probe(args: list[str]) -> int:
    from . import probes

    if not args or args[0] in ("-h", "--help", "--list"):
        print("gcmoe-lab probe NAME [ARGS]  (NAME --help for its arguments)\n")
        print(probes.listing())
        return 0
    try:
        module = probes.load(args[0])
    except KeyError as e:
        print(f"gcmoe-lab probe: {e.args[0]}", file=sys.stderr)
        return 2
    return int(module.main(args[1:]) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(
        prog="gcmoe-lab",
        description="gcmoe's lab: benchmarks, tuner, multi-GPU harness and probes",
        epilog="each command parses its own arguments: gcmoe-lab COMMAND --help",
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, what in COMMANDS.items():
        sub.add_parser(name, help=what, add_help=False)  # (its own parser reads the rest: run)
    ns = ap.parse_args(argv[:1])
    return run(ns.command, argv[1:])


if __name__ == "__main__":
    sys.exit(main())
