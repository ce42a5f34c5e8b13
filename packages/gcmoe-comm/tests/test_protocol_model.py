"""The ring / counter / parity protocol, explored exhaustively for small configurations and randomly beyond; and
proof that the explorer catches seeded bugs (so a clean report means something)."""

import pytest

from gcmoe_comm.protocol_model import Config, Variant, explore, random_walks

EXHAUSTIVE = [
    Config(ranks=1, blocks=3, generations=3),
    Config(ranks=2, blocks=1, generations=3),
    Config(ranks=2, blocks=2, generations=3),
    Config(ranks=2, blocks=3, generations=2),
    Config(ranks=3, blocks=1, generations=2),
    Config(ranks=3, blocks=2, generations=2),
]


@pytest.mark.parametrize("cfg", EXHAUSTIVE, ids=lambda c: f"P{c.ranks}-B{c.blocks}-G{c.generations}")
def test_protocol_exhaustive(cfg):
    rep = explore(cfg)
    assert rep.ok, (rep.deadlocks, rep.violations)
    assert rep.states > 10


@pytest.mark.slow
def test_protocol_exhaustive_p3_three_generations():
    rep = explore(Config(ranks=3, blocks=2, generations=3))
    assert rep.ok, (rep.deadlocks, rep.violations)


@pytest.mark.parametrize("cfg", [Config(4, 3, 4), Config(6, 2, 3), Config(8, 4, 3)], ids=["P4", "P6", "P8"])
def test_protocol_random_walks(cfg):
    rep = random_walks(cfg, walks=150, seed=cfg.ranks)
    assert rep.ok, (rep.deadlocks, rep.violations)


@pytest.mark.parametrize(
    ("variant", "message"),
    [
        (Variant(signal_first=True), "of generation 2"),
        (Variant(accept_stale_tags=True), "consumed ring block"),
        (Variant(skip_ready_wait=True), "generation"),
    ],
    ids=["signal-early", "stale-tags", "no-ready-wait"],
)
def test_explorer_catches_seeded_bugs(variant, message):
    rep = explore(Config(ranks=2, blocks=2, generations=3, variant=variant))
    assert rep.violations and message in rep.violations[0], rep


def test_single_counter_is_safe_under_the_routing_handshake():
    assert explore(Config(ranks=3, blocks=1, generations=3, variant=Variant(single_recv_counter=True))).ok
