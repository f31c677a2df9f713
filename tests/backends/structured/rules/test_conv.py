"""The convolution rule, each op alone, against the dense oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchgram.backends.structured.rules.conv import ConvRule, patches, resolve_padding

B = 3
EVEN_SAME = "ignore:Using padding='same' with even kernel:UserWarning"
WAYS = ["ghost", "materialize"]

# name: (conv, weight shape, input shape (per batch), keyword options)
CASES = {
    "conv2d": (F.conv2d, (4, 2, 3, 3), (B, 2, 6, 6), {}),
    "conv2d_stride_padding": (F.conv2d, (4, 2, 3, 3), (B, 2, 7, 7), dict(stride=2, padding=1)),
    "conv2d_groups_dilation": (F.conv2d, (4, 2, 3, 3), (B, 4, 9, 9),
                               dict(groups=2, dilation=2, stride=2, padding=1)),
    "conv2d_rectangular": (F.conv2d, (3, 2, 2, 3), (B, 2, 5, 6), dict(stride=(1, 2),
                                                                     padding=(1, 0))),
    "conv2d_same_even_kernel": (F.conv2d, (3, 2, 2, 4), (B, 2, 5, 6), dict(padding="same",
                                                                          dilation=(1, 2))),
    "conv2d_valid": (F.conv2d, (3, 2, 3, 3), (B, 2, 5, 5), dict(padding="valid")),
    "conv2d_depthwise": (F.conv2d, (4, 1, 3, 3), (B, 4, 5, 5), dict(groups=4, padding=1)),
    # NOTE [per-sample depthwise gradients]: multipliers, strides that leave inputs unread,
    # dilations, uneven padding, 1-D and 3-D
    "conv2d_depthwise_multiplier": (F.conv2d, (6, 1, 3, 2), (B, 3, 8, 7),
                                    dict(groups=3, stride=(2, 3), padding=(1, 0))),
    "conv2d_depthwise_same_dilated": (F.conv2d, (4, 1, 2, 3), (B, 4, 6, 7),
                                      dict(groups=4, padding="same", dilation=(2, 1))),
    "conv1d_depthwise": (F.conv1d, (4, 1, 3), (B, 4, 10), dict(groups=4, stride=3, dilation=2)),
    "conv3d_depthwise": (F.conv3d, (4, 1, 2, 3, 2), (B, 2, 5, 4, 3),
                         dict(groups=2, stride=2, padding=1)),
    # many positions: the grouped weight-gradient kernel, or (1×1) patches that are the input
    "conv2d_many_positions": (F.conv2d, (2, 8, 3, 3), (B, 8, 16, 16), dict(padding=1)),
    "conv2d_pointwise_many_positions": (F.conv2d, (3, 8, 1, 1), (B, 8, 16, 16), {}),
    "conv1d": (F.conv1d, (3, 2, 3), (B, 2, 8), dict(stride=2, padding=2, dilation=2)),
    "conv1d_same": (F.conv1d, (3, 2, 4), (B, 2, 7), dict(padding="same")),
    "conv3d_groups": (F.conv3d, (4, 1, 2, 2, 2), (B, 2, 4, 4, 3), dict(groups=2, padding=1)),
    "conv1d_unbatched": (F.conv1d, (3, 2, 3), (2, 8), {}),
}


def _f(conv, options, bias):
    def f(p, x):
        y = conv(x, p["w"], p.get("b") if bias else None, **options)
        return torch.tanh(y).flatten(1).sum(1) if x.dim() > conv_nd(conv) + 1 \
            else torch.tanh(y).sum()[None]
    return f


def conv_nd(conv):
    return {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}[conv]


# An unbatched conv input has no sample dimension to declare: dense rows only.
GRID = [pytest.param(name, per_sample, id=f"{name}-{'batch' if per_sample else 'dense'}")
        for name in CASES for per_sample in (False, True)
        if not (per_sample and "unbatched" in name)]


@pytest.mark.filterwarnings(EVEN_SAME)
@pytest.mark.parametrize(("name", "per_sample"), GRID)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("way", WAYS)
def test_conv_matches_oracle(check, name, bias, way, per_sample):
    conv, w_shape, x_shape, options = CASES[name]
    unbatched = len(x_shape) == conv_nd(conv) + 1
    torch.manual_seed(0)
    params = {"w": torch.randn(*w_shape, dtype=torch.float64)}
    if bias:
        params["b"] = torch.randn(w_shape[0], dtype=torch.float64)
    x = torch.randn(*x_shape, dtype=torch.float64)
    check(_f(conv, options, bias), (params, x), force=way, batch_dim=0 if per_sample else None)
    if not unbatched:
        check(_f(conv, options, bias), (params, x), force=way,
              batch_dim=0 if per_sample else None, diagonal=True)


def test_ntk_of_grouped_conv(check):
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 2, 3, 3, dtype=torch.float64),
              "b": torch.randn(4, dtype=torch.float64)}

    def f(p, x):  # [B, 4] outputs
        return F.conv2d(x, p["w"], p["b"], groups=2, padding=1).tanh().mean((2, 3))

    x = torch.randn(B, 4, 5, 5, dtype=torch.float64)
    for way in WAYS:
        check(f, (params, x), force=way, batch_dim=0)
        check(f, (params, x), force=way, batch_dim=None)


@pytest.mark.parametrize("way", WAYS)
def test_depthwise_conv_with_rows_and_inner_batch(check, way):
    """Several rows per sample, and several images per sample (summed per sample)."""
    torch.manual_seed(0)
    params = {"w": torch.randn(6, 1, 3, 3, dtype=torch.float64)}

    def rows(p, x):  # [B, 6] outputs
        return F.conv2d(x, p["w"], groups=3, stride=2, padding=1).tanh().mean((2, 3))

    def images(p, x):  # x: [B, 2, 3, 5, 5], two images per sample
        y = F.conv2d(x.flatten(0, 1), p["w"], groups=3, padding=1).tanh()
        return y.reshape(x.shape[0], -1).sum(1)

    check(rows, (params, torch.randn(B, 3, 5, 5, dtype=torch.float64)), force=way, batch_dim=0)
    check(images, (params, torch.randn(B, 2, 3, 5, 5, dtype=torch.float64)), force=way,
          batch_dim=0)


@pytest.mark.filterwarnings(EVEN_SAME)
@pytest.mark.parametrize("name", [n for n in CASES if "unbatched" not in n])
def test_patches_reproduce_the_convolution(name):
    conv, w_shape, x_shape, options = CASES[name]
    torch.manual_seed(0)
    x = torch.randn(*x_shape, dtype=torch.float64)
    w = torch.randn(*w_shape, dtype=torch.float64)
    nd = conv_nd(conv)
    match = ConvRule().match(conv, (x, w), options)
    assert match is not None
    layout = match.operands[0].layout
    cols = patches(x, layout.kernel, layout.stride, layout.padding, layout.dilation)
    groups = layout.groups
    y = conv(x, w, **options)
    per_group = cols.reshape(cols.shape[0], groups, -1, cols.shape[-1])
    w_groups = w.reshape(groups, w_shape[0] // groups, -1)
    out = torch.einsum("ngkl,gok->ngol", per_group, w_groups).reshape(x.shape[0], w_shape[0],
                                                                    *y.shape[2:])
    assert y.dim() == nd + 2
    torch.testing.assert_close(out, y)


def test_padding_resolution():
    assert resolve_padding("same", (3,), (2,)) == ((2, 2),)
    assert resolve_padding("same", (2,), (1,)) == ((0, 1),)
    assert resolve_padding((1, 2), (3, 3), (1, 1)) == ((1, 1), (2, 2))
    assert resolve_padding("circular", (3,), (1,)) is None


def test_transposed_convolution_falls_back(check, ways):
    torch.manual_seed(0)
    params = {"w": torch.randn(2, 3, 3, 3, dtype=torch.float64)}

    def f(p, x):
        return F.conv_transpose2d(x, p["w"]).tanh().flatten(1).sum(1)

    x = torch.randn(B, 2, 4, 4, dtype=torch.float64)
    assert ways(f, (params, x), batch_dim=0) == ["fallback"]
    check(f, (params, x), force=None, batch_dim=0)
