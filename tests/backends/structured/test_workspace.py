"""The buffer the contraction's large temporaries take in turn (NOTE [workspace])."""

from __future__ import annotations

import torch

from torchgram.backends.structured.workspace import Workspace


def test_loans_share_one_buffer_that_grows_to_the_largest():
    workspace = Workspace()
    device = torch.device("cpu")
    small = workspace.take((2, 3), torch.float64, device)
    same = workspace.take((6,), torch.float32, device)
    assert small.data_ptr() == same.data_ptr()
    large = workspace.take((4, 5), torch.float64, device)
    assert large.shape == (4, 5) and large.is_contiguous()
    assert workspace._buffer is not None and workspace._buffer.numel() == 160
    again = workspace.take((3,), torch.float64, device)
    assert again.data_ptr() == large.data_ptr()


def test_zeros_are_zeros_after_earlier_loans():
    workspace = Workspace()
    workspace.take((10,), torch.float32, torch.device("cpu")).fill_(7.0)
    zeros = workspace.zeros((2, 5), torch.float32, torch.device("cpu"))
    assert torch.equal(zeros, torch.zeros(2, 5))
