"""BufferPool: what comes back is handed out again, and never while another tensor shares it."""

from __future__ import annotations

import torch

from megazpp.zero.buffers import BufferPool


def test_a_returned_buffer_is_reused_by_size_dtype_and_device():
    pool = BufferPool()
    like = torch.zeros(1)
    a = pool.take(8, like)
    pool.give(a)
    assert pool.take(8, like) is a and pool.allocations == 1
    b = pool.take(8, like)  # a is out again: a new buffer
    c = pool.take(4, like)  # another size
    d = pool.take(8, torch.zeros(1, dtype=torch.float64))  # another dtype
    assert len({id(a), id(b), id(c), id(d)}) == 4 and pool.allocations == 4
    for t in (a, b, c, d):
        pool.give(t)
    assert pool.held() == pool.allocations == 4


def test_a_shared_buffer_waits_until_its_sharers_are_gone():
    pool = BufferPool()
    like = torch.zeros(1)
    a = pool.take(8, like)
    view = a[2:5]  # e.g. a view autograd saved, or a caller's detached parameter
    pool.give(a)
    b = pool.take(8, like)
    assert b is not a and pool.held() == 1  # a waits, b is new
    view.fill_(7.0)
    del view
    pool.give(b)
    assert {id(pool.take(8, like)), id(pool.take(8, like))} == {id(a), id(b)} and pool.allocations == 2


def test_tensors_the_pool_did_not_hand_out_are_left_alone():
    pool = BufferPool()
    a = pool.take(8, torch.zeros(1))
    pool.give(a[:4])  # a view of it
    pool.give(torch.zeros(8))  # a stranger
    assert pool.held() == 0
    pool.give(a)
    pool.give(a)  # twice: once only
    assert pool.held() == 1
    del a  # a dropped buffer is not kept by the pool's record of what is out
    b = pool.take(8, torch.zeros(1))
    c = pool.take(8, torch.zeros(1))
    del c
    assert pool.held() == 0 and b.numel() == 8
