"""The comm tests' helper modules live beside them (protocol_model, virtual_ranks, fault_injection, comm_multiproc):
test-only code, kept out of gcmoe_comm's src. pytest runs with --import-mode=importlib, which puts nothing on
sys.path, so this directory goes there (spawned ranks inherit it). Markers: the root conftest, as everywhere."""

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
