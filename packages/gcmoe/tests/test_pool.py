"""gcmoe.pool on CPU: the micro-batch context, the default pool per device, lanes held weakly, names for errors."""

import gc

import pytest

import gcmoe
from gcmoe.pool import MICRO_BATCHES, LayerPool, current_micro_batch


def test_micro_batch_sets_the_index_for_the_block_only():
    assert current_micro_batch() == 0
    with gcmoe.micro_batch(1):
        assert current_micro_batch() == 1
        with gcmoe.micro_batch(0):
            assert current_micro_batch() == 0
        assert current_micro_batch() == 1
    assert current_micro_batch() == 0
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
