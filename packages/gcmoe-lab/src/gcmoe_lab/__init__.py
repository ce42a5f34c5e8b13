"""gcmoe-lab: benchmarks, tuner driver, multi-GPU harness, peers and probes of gcmoe (nothing in the product imports
it; the command: gcmoe_lab.cli)."""

__version__ = "0.1.0"
