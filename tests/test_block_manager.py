"""KV block accounting: unit cases, and a hypothesis state machine checking that no sequence of
operations leaks a block, double-frees one, or lets two live tables own one unshared block."""

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenwire.core.block_manager import BlockManager
from tokenwire.core.errors import BlockAccountingError


def test_allocate_append_free_round_trip():
    bm = BlockManager(num_blocks=8, block_size=4)
    table = []
    bm.append_slot(table, 1)
    assert len(table) == 1 and bm.num_used_blocks == 1
    bm.append_slot(table, 4)
    assert len(table) == 1                       # same block, one comparison
    bm.append_slot(table, 5)
    assert len(table) == 2 and bm.num_free_blocks == 6
    assert bm.can_append_slot(table, 32) and not bm.can_append_slot(table, 33)
    bm.free(table)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0


def test_exhaustion_and_errors_are_named():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = bm.allocate(2)
    assert not bm.can_allocate(1) and bm.usage == 1.0
    with pytest.raises(BlockAccountingError, match="asked for 1 KV blocks, 0 are free"):
        bm.allocate(1)
    bm.free(a)
    with pytest.raises(BlockAccountingError, match="double free"):
        bm.free(a)
    with pytest.raises(BlockAccountingError, match="double free"):
        bm.free([99])
    assert bm.num_free_blocks == 2
    with pytest.raises(ValueError):
        BlockManager(0, 16)


def test_append_block_takes_one_free_block_with_one_holder():
    bm = BlockManager(num_blocks=3, block_size=4)
    table = bm.allocate(1)
    bm.append_block(table)
    bm.append_block(table)
    assert table == [0, 1, 2] and bm.num_free_blocks == 0 and bm.ref_counts == [1, 1, 1]
    with pytest.raises(BlockAccountingError, match="asked for 1 KV block, 0 are free"):
        bm.append_block(table)
    assert table == [0, 1, 2]
    bm.free(table)
    assert bm.num_free_blocks == 3


def test_a_table_naming_a_block_twice_is_refused_without_damage():
    bm = BlockManager(num_blocks=4, block_size=4)
    (b,) = bm.allocate(1)
    with pytest.raises(BlockAccountingError):
        bm.free([b, b])
    assert bm.ref_counts[b] == 1 and bm.num_free_blocks == 3


def test_shared_block_is_free_only_after_its_last_holder():
    bm = BlockManager(num_blocks=4, block_size=4)
    t1 = bm.allocate(2)
    bm.share(t1[:1])                             # a second table reuses the prefix block
    t2 = [t1[0]] + bm.allocate(1)
    bm.free(t1)
    assert bm.num_free_blocks == 2 and bm.ref_counts[t1[0]] == 1
    bm.free(t2)
    assert bm.num_free_blocks == 4
    with pytest.raises(BlockAccountingError, match="not allocated"):
        bm.share([t1[0]])


class BlockManagerMachine(RuleBasedStateMachine):
    """Tables live in `self.tables`; the model of reference counts is recomputed from them."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=4)
        self.tables = []                         # list of (block list, tokens covered)

    @rule(num_tokens=st.integers(1, 20))
    def new_table(self, num_tokens):
        need = self.bm.num_blocks_for(num_tokens)
        if self.bm.can_allocate(need):
            self.tables.append([self.bm.allocate(need), num_tokens])
        else:
            with pytest.raises(BlockAccountingError):
                self.bm.allocate(need)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), more=st.integers(1, 9))
    def grow(self, data, more):
        entry = data.draw(st.sampled_from(self.tables))
        target = entry[1] + more
        if self.bm.can_append_slot(entry[0], target):
            self.bm.append_slot(entry[0], target)
            entry[1] = target
            assert len(entry[0]) == self.bm.num_blocks_for(target)
        else:
            with pytest.raises(BlockAccountingError):
                self.bm.append_slot(entry[0], target)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork_prefix(self, data):
        """A new table sharing the first blocks of an existing one."""
        entry = data.draw(st.sampled_from(self.tables))
        n = data.draw(st.integers(1, len(entry[0])))
        self.bm.share(entry[0][:n])
        self.tables.append([list(entry[0][:n]), n * self.bm.block_size])

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free_table(self, data):
        i = data.draw(st.integers(0, len(self.tables) - 1))
        blocks, _ = self.tables.pop(i)
        self.bm.free(blocks)
        if blocks and all(self.bm.ref_counts[b] == 0 for b in blocks):
            with pytest.raises(BlockAccountingError):   # the same table again: a double free
                self.bm.free(blocks)

    @rule(block=st.integers(-3, 20))
    def free_unheld_block(self, block):
        if 0 <= block < 12 and self.bm.ref_counts[block] > 0:
            return
        with pytest.raises(BlockAccountingError):
            self.bm.free([block])

    @invariant()
    def counts_match_tables(self):
        expected = [0] * self.bm.num_blocks
        for blocks, _ in self.tables:
            for b in blocks:
                expected[b] += 1
        assert self.bm.ref_counts == expected
        free = self.bm.free_block_ids
        assert len(set(free)) == len(free)                       # no block free twice
        assert set(free) == {b for b, c in enumerate(expected) if c == 0}   # no leak
        assert self.bm.num_used_blocks + self.bm.num_free_blocks == self.bm.num_blocks


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
