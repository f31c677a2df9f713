"""Vision models without torchvision (its wheel for torch 2.13 is a CUDA build): float64.

* ``resnet-eval`` / ``resnet-train``: a two-block ResNet (``BasicBlock`` with BatchNorm2d, a
  strided block with a 1×1 downsample conv + BatchNorm). In train mode the batch statistics
  couple the samples, and the running statistics are updated in place — on copies, through
  ``tg.functionalize``.
* ``mobilenet``: a MobileNetV3-like net in eval mode: depthwise separable inverted residuals
  (``groups=C``), BatchNorm, hardswish, squeeze-excite.

The builders take a ``norm`` factory, so :mod:`models.torchjd_ports` reuses them with
instance and group norm (torchjd's ``InstanceNormResNet18``, ``GroupNormMobileNetV3Small``,
``InstanceNormMobileNetV2``). Images are ``3 × 8 × 8``, ``B = 3``, 3 classes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.case import ModelCase, module_case

BATCH, CLASSES = 3, 3
Norm = Callable[[int], nn.Module]


class BasicBlock(nn.Module):
    """ResNet's basic block: conv-norm-relu-conv-norm, plus a (downsampled) shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int, norm: Norm) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = norm(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = norm(c_out)
        self.downsample: nn.Module | None = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                                            norm(c_out))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        shortcut = x if self.downsample is None else self.downsample(x)
        return torch.relu(h + shortcut)


class ResNet(nn.Module):
    """Stem conv, one identity block, one strided block with downsample, pooled linear head."""

    def __init__(self, norm: Norm = nn.BatchNorm2d, width: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), norm(width),
                                  nn.ReLU())
        self.layer1 = BasicBlock(width, width, 1, norm)
        self.layer2 = BasicBlock(width, 2 * width, 2, norm)
        self.fc = nn.Linear(2 * width, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        h = self.layer2(self.layer1(self.stem(x)))
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


class SqueezeExcite(nn.Module):
    """Channel gate: pooled features through a bottleneck and a hard sigmoid."""

    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, squeezed, 1)
        self.expand = nn.Conv2d(squeezed, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        scale = F.adaptive_avg_pool2d(x, 1)
        return x * F.hardsigmoid(self.expand(torch.relu(self.reduce(scale))))


class InvertedResidual(nn.Module):
    """Expand (1×1) - depthwise (k×k, ``groups=C``) - [squeeze-excite] - project (1×1)."""

    def __init__(self, c_in: int, expanded: int, c_out: int, stride: int, norm: Norm,
                 activation: type[nn.Module], squeeze_excite: bool) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(c_in, expanded, 1, bias=False), norm(expanded),
                                   activation(),
                                   nn.Conv2d(expanded, expanded, 3, stride=stride, padding=1,
                                             groups=expanded, bias=False),
                                   norm(expanded), activation()]
        if squeeze_excite:
            layers.append(SqueezeExcite(expanded, max(2, expanded // 4)))
        layers += [nn.Conv2d(expanded, c_out, 1, bias=False), norm(c_out)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: Tensor) -> Tensor:
        h = self.block(x)
        return x + h if self.residual else h


class MobileNet(nn.Module):
    """A MobileNetV2/V3-like net: strided stem, two inverted residuals, pooled classifier."""

    def __init__(self, norm: Norm = nn.BatchNorm2d, activation: type[nn.Module] = nn.Hardswish,
                 squeeze_excite: bool = True) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1, bias=False), norm(4),
                                  activation())
        self.blocks = nn.Sequential(
            InvertedResidual(4, 8, 4, 1, norm, activation, squeeze_excite),
            InvertedResidual(4, 8, 6, 2, norm, activation, squeeze_excite),
        )
        self.classifier = nn.Sequential(nn.Linear(6, 8), activation(), nn.Linear(8, CLASSES))

    def forward(self, x: Tensor) -> Tensor:
        h = self.blocks(self.stem(x))
        return self.classifier(F.adaptive_avg_pool2d(h, 1).flatten(1))


def randomize_running_stats(model: nn.Module) -> None:
    """Give every batch-norm non-trivial running statistics, as after some training."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            assert module.running_mean is not None and module.running_var is not None
            module.running_mean.normal_(0.0, 0.3)
            module.running_var.uniform_(0.5, 2.0)


def cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-sample losses ``[B]``."""
    return F.cross_entropy(logits, labels, reduction="none")


def image_case(name: str, model: nn.Module, **extra: Any) -> ModelCase:
    """Per-sample classification losses of ``model`` on ``B`` random ``3×8×8`` images."""
    model.to(torch.float64)
    images = torch.randn(BATCH, 3, 8, 8, dtype=torch.float64)
    labels = torch.randint(0, CLASSES, (BATCH,))
    return module_case(name, model, (images, labels), head=cross_entropy,
                       output_shape=(BATCH,), **extra)


def resnet(train: bool) -> ModelCase:
    model = ResNet()
    randomize_running_stats(model)
    model.train(train)
    if train:
        return image_case("resnet-train", model, coupled=True,
                          note="ResNet, BatchNorm2d in train mode (batch statistics)")
    return image_case("resnet-eval", model, note="ResNet, BatchNorm2d in eval mode")


def mobilenet() -> ModelCase:
    model = MobileNet()
    randomize_running_stats(model)
    model.eval()
    return image_case("mobilenet", model,
                      note="MobileNetV3-like: depthwise convs, BatchNorm, hardswish, SE")


BUILDERS: dict[str, Callable[[], ModelCase]] = {
    "resnet-eval": lambda: resnet(train=False),
    "resnet-train": lambda: resnet(train=True),
    "mobilenet": mobilenet,
}
