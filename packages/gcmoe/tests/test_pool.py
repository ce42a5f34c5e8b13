"""gcmoe.pool on CPU: the micro-batch context, the default pool per device, lanes held weakly, names for errors."""

import gc

import pytest

import gcmoe
from gcmoe.pool import MICRO_BATCHES, LayerPool, current_micro_batch, in_micro_batch


def test_micro_batch_sets_the_index_for_the_block_only():
    assert current_micro_batch() == 0 and not in_micro_batch()
    with gcmoe.micro_batch(1):
        assert current_micro_batch() == 1 and in_micro_batch()
        with gcmoe.micro_batch(0):
            assert current_micro_batch() == 0 and in_micro_batch()  # micro-batch 0: still a two-batch call
        assert current_micro_batch() == 1
    assert current_micro_batch() == 0 and not in_micro_batch()
    for bad in (-1, MICRO_BATCHES):
        with pytest.raises(ValueError, match=r"micro_batch: index .* outside"), gcmoe.micro_batch(bad):
            pass


def test_default_pool_is_one_per_device():
    assert gcmoe.default_pool("cpu") is gcmoe.default_pool("cpu")
    assert gcmoe.default_pool("cpu") is not gcmoe.default_pool("meta")


class _Lane:
    nbytes = 100

    def __init__(self):
        self.recovered = 0

    def check_step(self):
        pass

    def recover(self):
        self.recovered += 1


def test_a_pool_holds_lanes_weakly_and_makes_each_once():
    pool = LayerPool()
    made = []

    def make():
        made.append(_Lane())
        return made[-1]

    a = pool.lane(("shape", 1), make)
    assert pool.lane(("shape", 1), make) is a and len(made) == 1
    b = pool.lane(("shape", 2), make)
    assert pool.memory_bytes() == 200 and pool.describe() == {"lanes": 2, "memory_bytes": 200}
    pool.recover()
    assert a.recovered == b.recovered == 1
    del made[:], a
    gc.collect()
    assert pool.describe()["lanes"] == 1  # only b is still held (here)
    del b
    assert pool.lanes() == []


def test_a_pool_names_the_layer_of_a_ticket():
    pool = LayerPool()
    pool.name_ticket(7, "model.layers.3.mlp")
    assert pool.layer_of(7) == "model.layers.3.mlp"
    assert "ticket 8" in pool.layer_of(8)


def test_layers_take_a_pool_and_a_name_on_every_backend():
    cfg = gcmoe.MoEConfig(256, 128, 8, 2, max_tokens_per_rank=8)
    pool = LayerPool()
    layer = gcmoe.MoELayer(cfg, "cpu", emulate=True, pool=pool, name="layers.0.mlp")
    assert layer.options.pool is pool and layer.options.name == "layers.0.mlp"


@pytest.mark.parametrize("sm_count", [132, 78, 9])
@pytest.mark.parametrize("comm_sms", [0, 8, 16])
@pytest.mark.parametrize("calls", [1, 2, 4, 8, 16])
def test_spinning_grids_of_calls_in_flight_leave_an_sm_free(sm_count, comm_sms, calls):
    # the rule the two-lane protocol model motivates (gcmoe.backends.sm90.spin_caps): calls in flight at once spread
    # their peer-waiting CTAs (dispatch, finalize) over all but one SM of each kernel's pool, one CTA per SM at worst
    from gcmoe.backends.sm90 import spin_caps

    if comm_sms >= sm_count:
        return
    dispatch, finalize = spin_caps(sm_count, comm_sms, calls)
    if calls == 1:
        assert dispatch is finalize is None
        return
    comm_pool, compute_pool = comm_sms or sm_count, sm_count - comm_sms
    for cap, pool in ((dispatch, comm_pool), (finalize, compute_pool)):
        assert cap >= 1
        assert calls * cap <= pool - 1 or cap == 1  # (a pool smaller than the calls: one CTA each, the least)
    if calls * 1 <= comm_pool - 1:
        assert calls * (dispatch + 1) > comm_pool - 1  # the largest such grid: no SMs wasted
