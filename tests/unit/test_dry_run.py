"""The key under which capture_all's shape-only stand-ins share a fake run: equal exactly when
the inputs' metadata is, never holding a tensor (whose reused id could alias a freed one)."""

from __future__ import annotations

import torch

from cgcompile.backend.dry_run import _describe


def test_tensors_of_one_layout_share_a_key_and_other_layouts_do_not():
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    assert _describe(a) == _describe(b)
    assert _describe(a) != _describe(a.t().contiguous().t())  # same shape, other strides
    assert _describe(a) != _describe(torch.randn(4, 8).to(torch.float64))
    assert _describe(a) != _describe(torch.randn(5, 8))
    assert _describe(a) != _describe(torch.randn(8, 8)[4:])  # another storage offset


def test_lists_are_described_element_by_element_without_their_tensors():
    key = _describe([torch.randn(2, 3), 4, None])
    assert key == _describe([torch.randn(2, 3), 4, None])
    assert key != _describe((torch.randn(2, 3), 4, None))  # a tuple is not a list

    def tensors(value):
        if isinstance(value, tuple):
            return any(tensors(v) for v in value)
        return isinstance(value, torch.Tensor)

    assert not tensors(key)


def test_an_argument_of_unknown_kind_is_never_shared():
    class Config:
        pass

    config = Config()
    assert _describe(config) != _describe(config)
