"""The runtime partition policy (gcmoe.policy) on a CPU: precedence (env > cache > defaults), env validation, the
cache file it reads (as the tuner, gcmoe-lab tune, writes it), a bad cache file falling back to the defaults, and the
two-batch schedule beside the one-batch one (its own cache entry, forced with it by the environment)."""

import json
import math

import pytest

from gcmoe import policy as policy_mod
from gcmoe_core.config import MoEConfig

CFG = MoEConfig.ep_slice("deepseek-v3", 8, max_tokens_per_rank=256)
H200, SMS = "NVIDIA H200", 132


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("GCMOE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("GCMOE_COMM_SMS", raising=False)


def write_cache(cfg: MoEConfig, device: str, comm_sms: int, above: int, two_batch: dict | None = None) -> dict:
    """A tuned cache file as the tuner writes it (key, policy and the rest of its record; two_batch: the two-batch
    entry, if any); returns its contents."""
    record = {
        "key": policy_mod.shape_key(cfg, device),
        "label": "deepseek-v3",
        "policy": {"comm_sms": comm_sms, "unpartitioned_above": above},
        "tokens": [1, 8, 32, 128, 256],
        "comm_sizes": [0, comm_sms],
        "times_us": {},
    }
    if two_batch is not None:
        record["two_batch"] = two_batch
    path = policy_mod.cache_path(cfg, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    return record


def test_policy_mode_for():
    p = policy_mod.Policy(16, 32, "test")
    assert [p.mode_for(t) for t in (1, 32, 33, 256)] == [16, 16, 0, 0]
    assert [p.mode_for(t, two_batch=True) for t in (1, 32, 256)] == [0, 0, 0]  # two-batch: never unless given
    assert [policy_mod.Policy(24, math.inf, "env").mode_for(t) for t in (1, 4096)] == [24, 24]
    assert [policy_mod.Policy(0, 0, "never").mode_for(t) for t in (1, 256)] == [0, 0]


def test_policy_mode_for_two_batch():
    """Each schedule has its own size and threshold; two_batch=False is the one-batch one."""
    p = policy_mod.Policy(0, 0, "test", 8, 8)
    assert [p.mode_for(t, two_batch=True) for t in (1, 8, 9, 256)] == [8, 8, 0, 0]
    assert [p.mode_for(t) for t in (1, 8)] == [p.mode_for(t, False) for t in (1, 8)] == [0, 0]
    q = policy_mod.Policy(16, 32, "test", 24, 1)
    assert [(q.mode_for(t), q.mode_for(t, two_batch=True)) for t in (1, 2, 32, 33)] == [
        (16, 24),
        (16, 0),
        (16, 0),
        (0, 0),
    ]
    forced = policy_mod.Policy(16, math.inf, "MoELayer(comm_sms=16)", 16, math.inf)  # as the backend builds it
    assert {forced.mode_for(t, b) for t in (1, 4096) for b in (False, True)} == {16}


def test_policy_precedence_env_over_cache_over_defaults(monkeypatch):
    assert policy_mod.policy(CFG, H200, SMS) == policy_mod.Policy(0, 0, "default for NVIDIA H200")
    other = policy_mod.policy(CFG, "NVIDIA H100 80GB HBM3", SMS)
    fields = (other.comm_sms, other.unpartitioned_above, other.two_batch_comm_sms, other.two_batch_unpartitioned_above)
    assert fields == policy_mod.GENERIC_DEFAULT == (0, 0, 0, 0) and "generic" in other.source
    assert policy_mod.DEFAULTS["NVIDIA H200"] == (0, 0, 0, 0)  # no partition in either schedule until tuned

    write_cache(CFG, H200, 16, 32)
    path = policy_mod.cache_path(CFG, H200)
    assert path.exists() and path.parent.name == "tune"
    assert policy_mod.policy(CFG, H200, SMS) == policy_mod.Policy(16, 32, f"tuned {path}")
    # another shape or device does not see it
    assert policy_mod.policy(MoEConfig.ep_slice("deepseek-v4-flash", 8), H200, SMS).source == "default for NVIDIA H200"
    assert policy_mod.policy(CFG, "NVIDIA H100 80GB HBM3", SMS).source.startswith("generic default")

    monkeypatch.setenv("GCMOE_COMM_SMS", "40")  # forces both schedules, at every T
    p = policy_mod.policy(CFG, H200, SMS)
    assert p == policy_mod.Policy(40, math.inf, "env GCMOE_COMM_SMS=40", 40, math.inf)
    assert {p.mode_for(t, b) for t in (1, 256, 4096) for b in (False, True)} == {40}
    monkeypatch.setenv("GCMOE_COMM_SMS", "0")
    p = policy_mod.policy(CFG, H200, SMS)
    assert p == policy_mod.Policy(0, 0, "env GCMOE_COMM_SMS=0", 0, 0)
    assert {p.mode_for(t, b) for t in (1, 256) for b in (False, True)} == {0}
    monkeypatch.setenv("GCMOE_COMM_SMS", "")  # blank = unset
    assert policy_mod.policy(CFG, H200, SMS).source == f"tuned {path}"


@pytest.mark.parametrize("raw", ["12", "-8", "124", "128", "132", "sixteen", "16.0"])
def test_bad_env_value_names_the_variable_and_the_valid_sizes(monkeypatch, raw):
    monkeypatch.setenv("GCMOE_COMM_SMS", raw)
    with pytest.raises(ValueError, match=r"GCMOE_COMM_SMS.*valid: 0 \(no partition\) or 8\.\.120 in steps of 8"):
        policy_mod.policy(CFG, H200, SMS)


def test_env_accepts_the_largest_valid_size(monkeypatch):
    monkeypatch.setenv("GCMOE_COMM_SMS", "120")
    assert policy_mod.policy(CFG, H200, SMS).comm_sms == 120


def test_cache_path_and_key():
    path = policy_mod.cache_path(CFG, H200)
    assert path.name == "h200-h7168-i2048-e32-k8-s1-ep1.json"
    assert policy_mod.shape_key(CFG, H200) == {
        "device": H200,
        "hidden_size": 7168,
        "intermediate_size": 2048,
        "local_experts": 32,
        "top_k": 8,
        "num_shared_experts": 1,
        "ep_size": 1,
    }


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda d: "{not json",
        lambda d: json.dumps({**d, "policy": {"comm_sms": 12, "unpartitioned_above": 32}}),
        lambda d: json.dumps({**d, "policy": {"comm_sms": 16, "unpartitioned_above": -1}}),
        lambda d: json.dumps({**d, "key": {**d["key"], "top_k": 6}}),
        lambda d: json.dumps({"policy": d["policy"]}),
    ],
    ids=["not-json", "bad-size", "bad-threshold", "other-shape", "no-key"],
)
def test_bad_cache_file_warns_and_falls_back_to_the_default(corrupt):
    record = write_cache(CFG, H200, 16, 32)
    policy_mod.cache_path(CFG, H200).write_text(corrupt(record))
    with pytest.warns(RuntimeWarning, match="ignoring the tuned partition policy"):
        p = policy_mod.policy(CFG, H200, SMS)
    assert p == policy_mod.Policy(0, 0, "default for NVIDIA H200")


def test_cache_two_batch_entry(monkeypatch):
    """The cache's optional "two_batch" entry gives the two-batch schedule; without it two-batch calls never
    partition; the environment overrides it as it does the one-batch entry."""
    write_cache(CFG, H200, 0, 0)
    path = policy_mod.cache_path(CFG, H200)
    assert policy_mod.policy(CFG, H200, SMS) == policy_mod.Policy(0, 0, f"tuned {path}", 0, 0)
    write_cache(CFG, H200, 0, 0, {"comm_sms": 16, "unpartitioned_above": 8})
    p = policy_mod.policy(CFG, H200, SMS)
    assert p == policy_mod.Policy(0, 0, f"tuned {path}", 16, 8)
    assert [(p.mode_for(t), p.mode_for(t, two_batch=True)) for t in (1, 8, 32)] == [(0, 16), (0, 16), (0, 0)]
    write_cache(CFG, H200, 24, 32, {"comm_sms": 0, "unpartitioned_above": 0})
    assert policy_mod.policy(CFG, H200, SMS) == policy_mod.Policy(24, 32, f"tuned {path}", 0, 0)
    assert policy_mod.policy(CFG, "NVIDIA H100 80GB HBM3", SMS).two_batch_comm_sms == 0  # another device: not it
    monkeypatch.setenv("GCMOE_COMM_SMS", "8")
    assert policy_mod.policy(CFG, H200, SMS) == policy_mod.Policy(8, math.inf, "env GCMOE_COMM_SMS=8", 8, math.inf)


@pytest.mark.parametrize(
    "entry",
    [
        {"comm_sms": 12, "unpartitioned_above": 8},
        {"comm_sms": 16, "unpartitioned_above": -1},
        {"comm_sms": 16, "unpartitioned_above": 8.5},
        {"comm_sms": 16},
        [16, 8],
        "16",
    ],
    ids=["bad-size", "bad-threshold", "float-threshold", "no-threshold", "a-list", "a-string"],
)
def test_bad_two_batch_entry_warns_and_is_ignored(entry):
    """A bad "two_batch" entry warns and is ignored: two-batch calls never partition, the one-batch entry stands."""
    write_cache(CFG, H200, 16, 32, entry)
    with pytest.warns(RuntimeWarning, match=r"ignoring the tuned two-batch partition policy .*never partition"):
        p = policy_mod.policy(CFG, H200, SMS)
    assert p == policy_mod.Policy(16, 32, f"tuned {policy_mod.cache_path(CFG, H200)}", 0, 0)
