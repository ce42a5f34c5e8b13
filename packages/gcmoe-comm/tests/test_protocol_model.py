"""The ring / counter / parity protocol, explored exhaustively for small configurations and randomly beyond; and
proof that the explorer catches seeded bugs (so a clean report means something)."""

from dataclasses import replace

import pytest
from protocol_model import Config, Variant, explore, random_walks

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
        (Variant(signal_first=True), "combine rows from rank"),
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


# The W1 -> W2 handoff per expert (W1_DONE count + tag); W2 of an expert runs beside the other experts' W1 tiles.
EXPERTS = [
    Config(ranks=1, blocks=1, generations=3, experts=2, m_tiles=2),
    Config(ranks=1, blocks=1, generations=3, experts=1, m_tiles=3),
    Config(ranks=2, blocks=1, generations=2, experts=2, m_tiles=2),
    Config(ranks=2, blocks=1, generations=3, experts=1, m_tiles=2),
    Config(ranks=1, blocks=1, generations=3, experts=2, m_tiles=2, w1_tail_overlap=True),
    Config(ranks=2, blocks=1, generations=3, experts=1, m_tiles=2, w1_tail_overlap=True),
]


@pytest.mark.parametrize(
    "cfg",
    EXPERTS,
    ids=lambda c: f"P{c.ranks}-E{c.experts}-M{c.m_tiles}-G{c.generations}" + ("-overlap" * c.w1_tail_overlap),
)
def test_expert_handoff_exhaustive(cfg):
    rep = explore(cfg)
    assert rep.ok, (rep.deadlocks, rep.violations)


EXPERT_BUG_CONFIGS = [
    Config(ranks=1, blocks=1, generations=3, experts=2, m_tiles=2),
    Config(ranks=2, blocks=1, generations=2, experts=1, m_tiles=2),
]


@pytest.mark.parametrize(
    ("variant", "message"),
    [
        (Variant(w2_accept_stale_w1_tag=True), "W1 rows of M tile 0 holding generation 1"),
        (Variant(w1_tag_every_tile=True), "W1 rows of M tile 0 holding generation 0"),
    ],
    ids=["w2-stale-w1-tag", "w1-tag-every-tile"],
)
@pytest.mark.parametrize("cfg", EXPERT_BUG_CONFIGS, ids=["P1-E2", "P2-E1"])
def test_explorer_catches_seeded_expert_bugs(cfg, variant, message):
    rep = explore(replace(cfg, variant=variant))
    assert rep.violations and "W2 of expert" in rep.violations[0] and message in rep.violations[0], rep


@pytest.mark.parametrize("cfg", EXPERT_BUG_CONFIGS, ids=["P1-E2", "P2-E1"])
def test_tag_before_reset_is_safe_under_the_stream_order(cfg):
    # the next call's W1 tiles start only after every tile of this call retired, so the order of the two stores of
    # the expert's last tile does not matter there
    variant = Variant(w1_tag_before_reset=True)
    assert explore(replace(cfg, variant=variant)).ok


@pytest.mark.parametrize("cfg", EXPERT_BUG_CONFIGS, ids=["P1-E2", "P2-E1"])
def test_tag_before_reset_breaks_once_w1_tails_overlap_the_next_call(cfg):
    variant = Variant(w1_tag_before_reset=True)
    rep = explore(replace(cfg, w1_tail_overlap=True, variant=variant))
    assert rep.violations and "count holds 2 before M tile" in rep.violations[0], rep


@pytest.mark.parametrize(
    "cfg",
    [
        Config(ranks=2, blocks=2, generations=3),
        Config(ranks=2, blocks=1, generations=3, experts=1, m_tiles=2, w1_tail_overlap=True),
        Config(ranks=2, blocks=2, generations=3, variant=Variant(signal_first=True)),
        Config(ranks=2, blocks=1, generations=2, experts=1, m_tiles=2, variant=Variant(w2_accept_stale_w1_tag=True)),
        Config(ranks=2, blocks=1, generations=2, w1_tail_overlap=True, variant=Variant(w1_tag_every_tile=True)),
        Config(ranks=2, blocks=1, generations=2, w1_tail_overlap=True, variant=Variant(w1_tag_before_reset=True)),
        Config(ranks=2, blocks=2, generations=2, variant=Variant(compute_skips_offs_wait=True)),
        Config(ranks=2, blocks=2, generations=2, variant=Variant(offs_before_offsets=True)),
        Config(ranks=2, blocks=2, generations=3, variant=Variant(inuse_freed_early=True)),
        Config(
            ranks=2, blocks=1, generations=3, variant=Variant(compute_skips_inuse_wait=True, cgen_before_reset=True)
        ),
    ],
    ids=[
        "shipped",
        "shipped-overlap",
        "signal-early",
        "w2-stale-w1-tag",
        "w1-tag-every-tile",
        "tag-before-reset",
        "no-offs-wait",
        "offs-first",
        "inuse-freed-early",
        "no-inuse-wait-cgen-first",
    ],
)
def test_reduction_keeps_the_verdict(cfg):
    full, reduced = explore(cfg, reduce=False), explore(cfg)
    assert (bool(full.deadlocks), bool(full.violations)) == (bool(reduced.deadlocks), bool(reduced.violations))
    assert reduced.states <= full.states


# OFFS, CGEN and INUSE: compute holds the call's ticket, derives g = CGEN + 1 and reads the ring's offsets after OFFS.
@pytest.mark.parametrize(
    "variant",
    [Variant(compute_skips_offs_wait=True), Variant(offs_before_offsets=True)],
    ids=["no-offs-wait", "offs-first"],
)
def test_explorer_catches_offs_bugs(variant):
    rep = explore(Config(ranks=2, blocks=1, generations=2, variant=variant))
    assert rep.violations and "compute read ring offsets of generation 0" in rep.violations[0], rep


@pytest.mark.parametrize(
    "variant",
    [Variant(compute_skips_inuse_wait=True), Variant(inuse_freed_early=True), Variant(cgen_before_reset=True)],
    ids=["no-inuse-wait", "inuse-freed-early", "cgen-first"],
)
def test_workspace_order_bugs_are_safe_on_one_lane(variant):
    # the lane's next call starts after this finalize ended, and only finalize changes CGEN and INUSE
    rep = explore(Config(ranks=2, blocks=2, generations=3, variant=variant))
    assert rep.ok, (rep.deadlocks, rep.violations)


TWO_LANES = [
    Config(ranks=1, blocks=1, generations=1, lanes=2),
    Config(ranks=1, blocks=2, generations=2, lanes=2, m_tiles=1),
    Config(ranks=1, blocks=1, generations=2, lanes=2, experts=2, m_tiles=2),
]


@pytest.mark.parametrize("cfg", TWO_LANES, ids=["C1", "B2-C2", "E2-C2"])
def test_two_lanes_on_one_workspace_are_refused_never_mixed(cfg):
    # either a call takes the workspace the other freed, or one finds it held (BUSY: ERR set, every wait ends)
    rep = explore(cfg)
    assert rep.ok, (rep.deadlocks, rep.violations)
    assert explore(replace(cfg, variant=Variant(cgen_before_reset=True))).ok


@pytest.mark.parametrize(
    "variant",
    [Variant(compute_skips_inuse_wait=True), Variant(inuse_freed_early=True)],
    ids=["no-inuse-wait", "inuse-freed-early"],
)
@pytest.mark.parametrize("cfg", TWO_LANES[:2], ids=["C1", "B2-C2"])
def test_explorer_catches_workspace_bugs_with_two_lanes(cfg, variant):
    rep = explore(replace(cfg, variant=variant))
    assert rep.violations and "compute read ring offsets of generation" in rep.violations[0], rep
