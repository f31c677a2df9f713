"""Ports of the architectures of torchjd's autogram tests (``tests/utils/architectures.py``).

Written from reading torchjd's file (TorchJD/torchjd, commits 057dcde and 2ed1d7c), not
copied: same structure and the same thing under test, much smaller sizes (``B = 3``, widths
2-9, images 8-16 px) so that every backend × ``batch_dim`` runs in milliseconds. Each case is
the raw module output, as torchjd's tests use it, so the output shapes vary (``[B]``,
``[B, K]``, ``[B, T, K]``, tuples and nested dicts of them). Case names are torchjd's class
names.

Ported: OverlyNested, MultiInputSingleOutput, MultiInputMultiOutput, SingleInputPyTreeOutput,
PyTreeInputSingleOutput, PyTreeInputPyTreeOutput, SimpleBranched, MISOBranched, MIMOBranched,
SIPOBranched, PISOBranched, PIPOBranched, WithNoTensorOutput, IntraModuleParamReuse (called
SimpleParamReuse in the older commit), InterModuleParamReuse, ModuleReuse, SomeUnusedParam,
SomeFrozenParam, WithSomeFrozenModule, RequiresGradOfSchrodinger, MultiOutputWithFrozenBranch,
WithBuffered, Randomness, WithSideEffect, SomeUnusedOutput, Ndim0Output ... Ndim4Output,
WithRNN, WithModuleTrackingRunningStats (instance norm with running stats, train mode),
WithBatchNorm (batch statistics: coupled samples), WithDropout, ModelUsingSubmoduleParamsDirectly,
ModelAlsoUsingSubmoduleParamsDirectly, WithModuleWithStringArg, WithModuleWithStringKwarg,
WithModuleWithHybridPyTreeArg, WithModuleWithHybridPyTreeKwarg, WithModuleWithStringOutput,
WithMultiHeadAttention (kdim/vdim differ from embed_dim), WithTransformer, FreeParam,
Cifar10Model; and, at toy scale without torchvision: AlexNet and SqueezeNet (rebuilt layer
types: strided convs, max-pools, Fire modules, dropout in train mode), InstanceNormResNet18,
GroupNormMobileNetV3Small and InstanceNormMobileNetV2 (on :mod:`models.vision`'s ResNet and
MobileNet with the norm swapped, like torchjd's ``norm_layer=``).

Not ported:

* NoFreeParam — FreeParam with the free matrix inside a bias-free ``nn.Linear``: torchjd keeps
  it for speed comparison only; for correctness it adds nothing to FreeParam + the zoo's MLPs.
* WithTransformerLarge — WithTransformer at ``d_model=512``: same architecture, only large.
* ShapedModule / ModuleFactory / get_in_out_shapes — test plumbing (shapes, seeding), not
  architectures; :class:`models.case.ModelCase` plays their role. Bare ``BatchNorm2d`` /
  ``InstanceNorm2d`` modules that torchjd also passes through get_in_out_shapes are covered by
  WithBatchNorm and WithModuleTrackingRunningStats.
* torchvision's exact ResNet18 / MobileNets / AlexNet / SqueezeNet at 224×224: torchvision
  does not import with CPU torch 2.13 here, and the full-size models take seconds per
  oracle; the toy versions keep their layer types.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from models.case import ModelCase, module_case
from models.vision import MobileNet, ResNet

BATCH = 3


def _randn(*shape: int) -> Tensor:
    return torch.randn(*shape, dtype=torch.float64)


# -- nesting, several inputs and outputs, pytrees ------------------------------------------------


class OverlyNested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        inner = nn.Sequential(nn.Sequential(nn.Linear(3, 4), nn.ReLU()), nn.Linear(4, 5))
        middle = nn.Sequential(inner, nn.ReLU(), nn.Linear(5, 6))
        outer = nn.Sequential(middle, nn.ReLU(), nn.Linear(6, 5), nn.ReLU())
        self.seq = nn.Sequential(outer, nn.Linear(5, 4))

    def forward(self, x: Tensor) -> Tensor:
        return self.seq(x)


class MultiInputSingleOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.matrix1 = nn.Parameter(torch.randn(5, 4))
        self.matrix2 = nn.Parameter(torch.randn(5, 4))

    def forward(self, inputs: tuple[Tensor, Tensor]) -> Tensor:
        first, second = inputs
        return first @ self.matrix1 + second @ self.matrix2


class MultiInputMultiOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.matrix11 = nn.Parameter(torch.randn(5, 4))
        self.matrix21 = nn.Parameter(torch.randn(5, 4))
        self.matrix12 = nn.Parameter(torch.randn(5, 3))
        self.matrix22 = nn.Parameter(torch.randn(5, 3))

    def forward(self, inputs: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        first, second = inputs
        return (first @ self.matrix11 + second @ self.matrix21,
                first @ self.matrix12 + second @ self.matrix22)


class SingleInputPyTreeOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.matrices = nn.ParameterList([nn.Parameter(torch.randn(5, k)) for k in (5, 4, 3, 2, 3)])

    def forward(self, x: Tensor) -> dict[str, Any]:
        m = self.matrices
        return {"first": (x @ m[0], [x @ m[1], x @ m[2]]), "second": x @ m[3],
                "third": ([(x @ m[4],)],)}


PYTREE_INPUT_WIDTHS = (2, 3, 2, 3, 2)
"""Widths of the five leaves of the pytree input, in the order they are read."""


def _split(x: Tensor) -> dict[str, Any]:
    pieces = x.split(PYTREE_INPUT_WIDTHS, dim=1)
    return {"one": [(pieces[0], [pieces[1], pieces[2]]), pieces[3]], "two": pieces[4]}


def _leaves_in_read_order(tree: dict[str, Any]) -> list[Tensor]:
    return [tree["one"][0][0], tree["one"][0][1][0], tree["one"][0][1][1], tree["one"][1],
            tree["two"]]


class _PyTreeInput(nn.Module):
    """One matrix per leaf of the pytree input; ``products`` multiplies each leaf by its own."""

    def __init__(self) -> None:
        super().__init__()
        self.matrices = nn.ParameterList(
            [nn.Parameter(torch.randn(w, k))
             for w, k in zip(PYTREE_INPUT_WIDTHS, (3, 2, 4, 2, 3), strict=True)])

    def products(self, tree: dict[str, Any]) -> list[Tensor]:
        return [x @ m for x, m in zip(_leaves_in_read_order(tree), self.matrices, strict=True)]


class PyTreeInputSingleOutput(_PyTreeInput):
    def forward(self, tree: dict[str, Any]) -> Tensor:
        return torch.cat(self.products(tree), dim=1)


class PyTreeInputPyTreeOutput(_PyTreeInput):
    def forward(self, tree: dict[str, Any]) -> dict[str, Any]:
        o = self.products(tree)
        return {"first": (o[0], [o[1], o[2]]), "second": o[3], "third": ([(o[4],)],)}


def _flatten_pytree_output(out: dict[str, Any]) -> Tensor:
    first, second, third = out["first"], out["second"], out["third"]
    return torch.cat([first[0], first[1][0], first[1][1], second, third[0][0][0]], dim=1)


class SimpleBranched(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc0, self.fc1, self.fc2 = nn.Linear(4, 5), nn.Linear(5, 4), nn.Linear(4, 3)
        self.fc3, self.fc4 = nn.Linear(5, 3), nn.Linear(3, 4)

    def forward(self, x: Tensor) -> Tensor:
        common = torch.relu(self.fc0(x))
        branch1 = self.fc2(torch.relu(self.fc1(common)))
        return self.fc4(torch.relu(branch1 + self.fc3(common)))


class MISOBranched(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.miso = MultiInputSingleOutput()

    def forward(self, x: Tensor) -> Tensor:
        return self.miso((x, x))


class MIMOBranched(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mimo = MultiInputMultiOutput()

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat(self.mimo((x, x)), dim=1)


class SIPOBranched(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sipo = SingleInputPyTreeOutput()

    def forward(self, x: Tensor) -> Tensor:
        return _flatten_pytree_output(self.sipo(x))


class PISOBranched(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.piso = PyTreeInputSingleOutput()

    def forward(self, x: Tensor) -> Tensor:
        return self.piso(_split(x))


class PIPOBranched(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pipo = PyTreeInputPyTreeOutput()

    def forward(self, x: Tensor) -> Tensor:
        return _flatten_pytree_output(self.pipo(_split(x)))


class _Holder(nn.Module):
    """A module with a parameter whose forward returns ``result`` (no tensor at all)."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self.matrix = nn.Parameter(torch.randn(4, 3))
        self.result = result

    def forward(self, _: Any) -> Any:
        return self.result


class WithNoTensorOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.none_output = _Holder(None)
        self.none_pytree_output = _Holder({"one": [None, ()], "two": None})
        self.empty_tuple_output = _Holder(())
        self.empty_pytree_output = _Holder({"one": [(), ()], "two": [[], []]})
        self.linear = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        for module in (self.none_output, self.none_pytree_output, self.empty_tuple_output,
                       self.empty_pytree_output):
            module(x)
        return self.linear(x)


# -- reuse, frozen and unused parameters, buffers, side effects ----------------------------------


class IntraModuleParamReuse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.matrix = nn.Parameter(torch.randn(5, 3))

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.matrix + (x**2 / 5.0) @ self.matrix


class _MatMul(nn.Module):
    def __init__(self, matrix: nn.Parameter) -> None:
        super().__init__()
        self.matrix = matrix

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.matrix


class InterModuleParamReuse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        shared = nn.Parameter(torch.randn(5, 3))
        self.module1, self.module2 = _MatMul(shared), _MatMul(shared)

    def forward(self, x: Tensor) -> Tensor:
        return self.module1(x) + self.module2(x**2 / 5.0)


class ModuleReuse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.module(x) + self.module(x**2 / 5.0)


class SomeUnusedParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unused_param = nn.Parameter(torch.randn(5, 3))
        self.matrix = nn.Parameter(torch.randn(5, 3))

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.matrix


class SomeFrozenParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen_param = nn.Parameter(torch.randn(5, 3), requires_grad=False)
        self.matrix = nn.Parameter(torch.randn(5, 3))

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.matrix + (x**2 / 5.0) @ self.frozen_param


class WithSomeFrozenModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.non_frozen = nn.Linear(5, 3)
        self.all_frozen = nn.Linear(5, 3)
        self.all_frozen.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.all_frozen(x) + self.non_frozen(x**2 / 5.0)


class _FrozenAndUnusedTrainable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen_param = nn.Parameter(torch.randn(5, 4), requires_grad=False)
        self.non_frozen_param = nn.Parameter(torch.randn(5, 4))  # never used

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.frozen_param


class RequiresGradOfSchrodinger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weird_module = _FrozenAndUnusedTrainable()
        self.normal_module = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.normal_module(self.weird_module(x))


class MultiOutputWithFrozenBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen_param = nn.Parameter(torch.randn(5, 3), requires_grad=False)
        self.matrix = nn.Parameter(torch.randn(5, 3))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return (x**2 / 5.0) @ self.frozen_param, x @ self.matrix


class _Scaled(nn.Module):
    buffer: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("buffer", torch.tensor(1.5))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.buffer


class WithBuffered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.module_with_buffer = _Scaled()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(self.module_with_buffer(x))


class Randomness(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.matrix = nn.Parameter(torch.randn(4, 3))

    def forward(self, x: Tensor) -> Tensor:
        noise = torch.zeros_like(x)
        noise.normal_()
        return (x * noise) @ self.matrix


class WithSideEffect(nn.Module):
    buffer: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.matrix = nn.Parameter(torch.randn(4, 3))
        self.register_buffer("buffer", torch.zeros(4))

    def forward(self, x: Tensor) -> Tensor:
        self.buffer = self.buffer + 1.0  # rebinds the buffer during the forward
        return (x + self.buffer) @ self.matrix


class SomeUnusedOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1, self.linear2 = nn.Linear(4, 5), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        self.linear1(x)
        return self.linear2(x)


# -- output shapes -------------------------------------------------------------------------------


class Ndim0Output(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x).squeeze(dim=1) / 5.0


class Ndim1Output(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) / 5.0


class Ndim2Output(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1, self.linear2 = nn.Linear(5, 3), nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return torch.stack([self.linear1(x), self.linear2(x)], dim=1)


class Ndim3Output(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tensor = nn.Parameter(torch.randn(4, 2, 3, 2))

    def forward(self, x: Tensor) -> Tensor:
        return torch.einsum("bi,icde->bcde", x, self.tensor)


class Ndim4Output(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tensor = nn.Parameter(torch.randn(4, 2, 2, 2, 2))

    def forward(self, x: Tensor) -> Tensor:
        return torch.einsum("bi,icdef->bcdef", x, self.tensor)


# -- layers with state or randomness, attention --------------------------------------------------


class WithRNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.RNN(input_size=4, hidden_size=3, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        output, _ = self.rnn(x)
        return output


class WithModuleTrackingRunningStats(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.instance_norm = nn.InstanceNorm2d(3, affine=True, track_running_stats=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.instance_norm(x)


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.batch_norm = nn.BatchNorm2d(3, affine=True, track_running_stats=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.batch_norm(x)


class WithDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv2d = nn.Conv2d(3, 3, kernel_size=3)
        self.dropout = nn.Dropout2d(p=0.5)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.conv2d(self.dropout(x)))


class ModelUsingSubmoduleParamsDirectly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 3)

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.linear.weight.T + self.linear.bias


class ModelAlsoUsingSubmoduleParamsDirectly(ModelUsingSubmoduleParamsDirectly):
    def forward(self, x: Tensor) -> Tensor:
        return x @ self.linear.weight.T + self.linear.bias + self.linear(x)


class _WithStringArg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.matrix = nn.Parameter(torch.randn(2, 3))

    def forward(self, s: str, input: Tensor) -> Tensor:
        return input @ self.matrix * (2.0 if s == "two" else 1.0)


class WithModuleWithStringArg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.with_string_arg = _WithStringArg()

    def forward(self, x: Tensor) -> Tensor:
        return self.with_string_arg("two", x)


class WithModuleWithStringKwarg(WithModuleWithStringArg):
    def forward(self, x: Tensor) -> Tensor:
        return self.with_string_arg(s="two", input=x)


class _WithHybridPyTreeArg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.m0, self.m1 = nn.Parameter(torch.randn(2, 3)), nn.Parameter(torch.randn(2, 3))
        self.m2, self.m3 = nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.randn(2, 3))

    def forward(self, input: dict[str, Any]) -> Tensor:
        t0, t1, _, c0, (c1, _) = input["one"][0]
        t2, c2 = input["one"][1], input["one"][2]
        t3, c3 = input["two"], input["three"]
        return c0 * t0 @ self.m0 + c1 * t1 @ self.m1 + c2 * t2 @ self.m2 + c3 * t3 @ self.m3


def _hybrid_tree(h: Tensor) -> dict[str, Any]:
    t0, t1, t2, t3 = h.split((2, 2, 3, 2), dim=1)
    return {"zero": "unused", "one": [(t0, t1, "unused", 0.2, [0.3, "unused"]), t2, 0.4, "unused"],
            "two": t3, "three": 0.5}


class WithModuleWithHybridPyTreeArg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 9)
        self.with_hybrid_arg = _WithHybridPyTreeArg()

    def forward(self, x: Tensor) -> Tensor:
        return self.with_hybrid_arg(_hybrid_tree(self.linear(x)))


class WithModuleWithHybridPyTreeKwarg(WithModuleWithHybridPyTreeArg):
    def forward(self, x: Tensor) -> Tensor:
        return self.with_hybrid_arg(input=_hybrid_tree(self.linear(x)))


class _WithStringOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.matrix = nn.Parameter(torch.randn(2, 3))

    def forward(self, x: Tensor) -> tuple[str, Tensor]:
        return "test", x @ self.matrix


class WithModuleWithStringOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.with_string_output = _WithStringOutput()

    def forward(self, x: Tensor) -> Tensor:
        return self.with_string_output(x)[1]


class WithMultiHeadAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(embed_dim=4, num_heads=2, dropout=0.0, batch_first=True,
                                         kdim=3, vdim=5)

    def forward(self, inputs: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        query, key, value = inputs
        return self.mha(query, key, value)[0]


class WithTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.Transformer(d_model=4, nhead=2, num_encoder_layers=1,
                                          num_decoder_layers=1, dim_feedforward=8,
                                          batch_first=True, dropout=0.0)

    def forward(self, inputs: tuple[Tensor, Tensor]) -> Tensor:
        source, target = inputs
        return self.transformer(source, target)


class FreeParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.matrix = nn.Parameter(torch.randn(4, 5))  # used directly, in no submodule
        self.linear1, self.linear2 = nn.Linear(5, 6), nn.Linear(6, 5)
        self.linear3, self.linear4 = nn.Linear(5, 4), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(x @ self.matrix)
        for layer in (self.linear1, self.linear2, self.linear3):
            h = torch.relu(layer(h))
        return self.linear4(h)


# -- image models --------------------------------------------------------------------------------


class Cifar10Model(nn.Module):
    """Conv body with grouped / depthwise convs and max-pools, MLP head (3×12×12 images)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 8, 3, groups=4),
            nn.Sequential(nn.MaxPool2d(2), nn.ReLU()), nn.Conv2d(8, 8, 3, groups=8),
            nn.Sequential(nn.MaxPool2d(2), nn.ReLU(), nn.Flatten()),
        )
        self.head = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))


class AlexNet(nn.Module):
    """AlexNet's layer types at toy scale (3×16×16): strided conv, max-pools, dropout MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 4, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d(2)
        self.classifier = nn.Sequential(
            nn.Dropout(0.5), nn.Linear(16, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 8),
            nn.ReLU(), nn.Linear(8, 3),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.avgpool(self.features(x)).flatten(1))


class Fire(nn.Module):
    """SqueezeNet's Fire module: 1×1 squeeze, then 1×1 and 3×3 expands concatenated."""

    def __init__(self, c_in: int, squeeze: int, expand: int) -> None:
        super().__init__()
        self.squeeze = nn.Conv2d(c_in, squeeze, 1)
        self.expand1x1 = nn.Conv2d(squeeze, expand, 1)
        self.expand3x3 = nn.Conv2d(squeeze, expand, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        s = torch.relu(self.squeeze(x))
        return torch.cat([torch.relu(self.expand1x1(s)), torch.relu(self.expand3x3(s))], dim=1)


class SqueezeNet(nn.Module):
    """SqueezeNet's layer types at toy scale (3×16×16): Fire modules, conv classifier, dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.MaxPool2d(3, 2, ceil_mode=True),
            Fire(8, 2, 4), Fire(8, 2, 4), nn.MaxPool2d(3, 2, ceil_mode=True), Fire(8, 3, 6),
        )
        self.classifier = nn.Sequential(nn.Dropout(0.5), nn.Conv2d(12, 3, 1), nn.ReLU(),
                                        nn.AdaptiveAvgPool2d(1), nn.Flatten())

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class Scaled(nn.Module):
    """``module(x) / divisor``, as torchjd scales its torchvision models' outputs."""

    def __init__(self, module: nn.Module, divisor: float) -> None:
        super().__init__()
        self.module = module
        self.divisor = divisor

    def forward(self, x: Tensor) -> Tensor:
        return self.module(x) / self.divisor


_instance_norm = partial(nn.InstanceNorm2d, affine=True, track_running_stats=False)


def _group_norm(channels: int) -> nn.Module:
    return nn.GroupNorm(2, channels, affine=True)


# -- registry ------------------------------------------------------------------------------------


def _port(name: str, module: Callable[[], nn.Module], inputs: Callable[[], tuple[Any, ...]],
          output_shape: tuple[int, ...] | None, *, seed: int | None = None,
          coupled: bool = False) -> tuple[str, Callable[[], ModelCase]]:
    """``(name, builder)``: ``module`` in float64, in train mode like torchjd's, raw output."""

    def builder() -> ModelCase:
        model = module().to(torch.float64).train()
        return module_case(name, model, inputs(), output_shape=output_shape, seed=seed,
                           coupled=coupled)

    return name, builder


def _vector(width: int) -> Callable[[], tuple[Any, ...]]:
    return lambda: (_randn(BATCH, width),)


def _image(channels: int, size: int) -> Callable[[], tuple[Any, ...]]:
    return lambda: (_randn(BATCH, channels, size, size),)


def _pair(*widths: int | tuple[int, ...]) -> Callable[[], tuple[Any, ...]]:
    return lambda: (tuple(_randn(BATCH, *w) if isinstance(w, tuple) else _randn(BATCH, w)
                          for w in widths),)


B = BATCH
BUILDERS: dict[str, Callable[[], ModelCase]] = dict([
    _port("OverlyNested", OverlyNested, _vector(3), (B, 4)),
    _port("MultiInputSingleOutput", MultiInputSingleOutput, _pair(5, 5), (B, 4)),
    _port("MultiInputMultiOutput", MultiInputMultiOutput, _pair(5, 5), None),
    _port("SingleInputPyTreeOutput", SingleInputPyTreeOutput, _vector(5), None),
    _port("PyTreeInputSingleOutput", PyTreeInputSingleOutput, lambda: (_split(_randn(B, 12)),),
          (B, 14)),
    _port("PyTreeInputPyTreeOutput", PyTreeInputPyTreeOutput, lambda: (_split(_randn(B, 12)),),
          None),
    _port("SimpleBranched", SimpleBranched, _vector(4), (B, 4)),
    _port("MISOBranched", MISOBranched, _vector(5), (B, 4)),
    _port("MIMOBranched", MIMOBranched, _vector(5), (B, 7)),
    _port("SIPOBranched", SIPOBranched, _vector(5), (B, 17)),
    _port("PISOBranched", PISOBranched, _vector(12), (B, 14)),
    _port("PIPOBranched", PIPOBranched, _vector(12), (B, 14)),
    _port("WithNoTensorOutput", WithNoTensorOutput, _vector(4), (B, 3)),
    _port("IntraModuleParamReuse", IntraModuleParamReuse, _vector(5), (B, 3)),
    _port("InterModuleParamReuse", InterModuleParamReuse, _vector(5), (B, 3)),
    _port("ModuleReuse", ModuleReuse, _vector(5), (B, 3)),
    _port("SomeUnusedParam", SomeUnusedParam, _vector(5), (B, 3)),
    _port("SomeFrozenParam", SomeFrozenParam, _vector(5), (B, 3)),
    _port("WithSomeFrozenModule", WithSomeFrozenModule, _vector(5), (B, 3)),
    _port("RequiresGradOfSchrodinger", RequiresGradOfSchrodinger, _vector(5), (B, 3)),
    _port("MultiOutputWithFrozenBranch", MultiOutputWithFrozenBranch, _vector(5), None),
    _port("WithBuffered", WithBuffered, _vector(4), (B, 3)),
    _port("Randomness", Randomness, _vector(4), (B, 3), seed=11),
    _port("WithSideEffect", WithSideEffect, _vector(4), (B, 3)),
    _port("SomeUnusedOutput", SomeUnusedOutput, _vector(4), (B, 3)),
    _port("Ndim0Output", Ndim0Output, _vector(5), (B,)),
    _port("Ndim1Output", Ndim1Output, _vector(5), (B, 3)),
    _port("Ndim2Output", Ndim2Output, _vector(5), (B, 2, 3)),
    _port("Ndim3Output", Ndim3Output, _vector(4), (B, 2, 3, 2)),
    _port("Ndim4Output", Ndim4Output, _vector(4), (B, 2, 2, 2, 2)),
    _port("WithRNN", WithRNN, lambda: (_randn(B, 4, 4),), (B, 4, 3)),
    _port("WithModuleTrackingRunningStats", WithModuleTrackingRunningStats, _image(3, 4),
          (B, 3, 4, 4)),
    _port("WithBatchNorm", WithBatchNorm, _image(3, 4), (B, 3, 4, 4), coupled=True),
    _port("WithDropout", WithDropout, _image(3, 5), (B, 3, 3, 3), seed=12),
    _port("ModelUsingSubmoduleParamsDirectly", ModelUsingSubmoduleParamsDirectly, _vector(2),
          (B, 3)),
    _port("ModelAlsoUsingSubmoduleParamsDirectly", ModelAlsoUsingSubmoduleParamsDirectly,
          _vector(2), (B, 3)),
    _port("WithModuleWithStringArg", WithModuleWithStringArg, _vector(2), (B, 3)),
    _port("WithModuleWithStringKwarg", WithModuleWithStringKwarg, _vector(2), (B, 3)),
    _port("WithModuleWithHybridPyTreeArg", WithModuleWithHybridPyTreeArg, _vector(4), (B, 3)),
    _port("WithModuleWithHybridPyTreeKwarg", WithModuleWithHybridPyTreeKwarg, _vector(4),
          (B, 3)),
    _port("WithModuleWithStringOutput", WithModuleWithStringOutput, _vector(2), (B, 3)),
    _port("WithMultiHeadAttention", WithMultiHeadAttention, _pair((3, 4), (2, 3), (2, 5)),
          (B, 3, 4)),
    _port("WithTransformer", WithTransformer, _pair((3, 4), (2, 4)), (B, 2, 4)),
    _port("FreeParam", FreeParam, _vector(4), (B, 3)),
    _port("Cifar10Model", Cifar10Model, _image(3, 12), (B, 3)),
    _port("AlexNet", AlexNet, _image(3, 16), (B, 3), seed=13),
    _port("InstanceNormResNet18", lambda: Scaled(ResNet(norm=_instance_norm), 5.0), _image(3, 8),
          (B, 3)),
    _port("GroupNormMobileNetV3Small",
          lambda: MobileNet(norm=_group_norm, activation=nn.Hardswish, squeeze_excite=True),
          _image(3, 8), (B, 3)),
    _port("SqueezeNet", SqueezeNet, _image(3, 16), (B, 3), seed=14),
    _port("InstanceNormMobileNetV2",
          lambda: Scaled(MobileNet(norm=_instance_norm, activation=nn.ReLU6,
                                   squeeze_excite=False), 10.0),
          _image(3, 8), (B, 3)),
])
