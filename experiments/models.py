"""Models for the experiment tasks and the DDP benchmarks, by name in :data:`MODELS`.

Small and plain on purpose: what is compared is gradient communication, so a model is here for the
shape and size of its gradients (MLP 1024-2048-2048-10: 6.32M parameters, 24.1 MB of fp32 gradients;
ResNet18: 11.2M parameters in 62 tensors of very different sizes) and for a loss that responds to
their quality.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn


class MLP(nn.Sequential):
    """Linear layers with ReLU between them; the input is flattened first.

    ``MLP(1024, [2048, 2048], 10)`` is the benchmark model of ``docs/architecture.md``: 6,316,042
    parameters, three buckets' worth of gradients under DDP's default 25 MB bucket cap.
    """

    def __init__(self, in_features: int, hidden: Sequence[int], out_features: int) -> None:
        widths = [in_features, *hidden]
        layers: list[nn.Module] = [nn.Flatten()]
        for width_in, width_out in itertools.pairwise(widths):
            layers += [nn.Linear(width_in, width_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], out_features))
        super().__init__(*layers)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a shortcut (1x1 convolution when the shape changes)."""

    def __init__(self, width_in: int, width: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width_in, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or width_in != width:
            self.shortcut = nn.Sequential(nn.Conv2d(width_in, width, 1, stride, bias=False), nn.BatchNorm2d(width))

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 images (He et al. 2016, CIFAR variant): a 3x3 stem without max pooling,
    BasicBlocks [2, 2, 2, 2] of widths 64-128-256-512, global average pooling; 11,173,962
    parameters for 10 classes.

    Written out here because the PyPI torchvision wheel fails to load against the CPU build of
    torch this project pins (its compiled operators do not match), and a benchmark model must not
    depend on that.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        blocks: list[nn.Module] = []
        width_in = 64
        for width, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [BasicBlock(width_in, width, stride), BasicBlock(width, width, 1)]
            width_in = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(512, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        features = self.blocks(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(features, 1), 1))


class SmallCNN(nn.Module):
    """Two 3x3 convolutions and a linear head, for small images (8x8 digits; any size works:
    the features are average-pooled to 2x2). About 6k parameters for 1 channel and 10 classes."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
        )
        self.head = nn.Linear(2 * width * 4, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.flatten(self.features(x), 1))


class SignalCNN(nn.Module):
    """A 1-D convolutional classifier for signals of shape (channels, length): three strided
    convolutions, average pooling down to 4 time steps (not 1: whether a frequency comes early or
    late in the window is what tells a rising chirp from a falling one), a linear head."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(in_channels, width, 9, stride=2, padding=4),
            nn.ReLU(),
            nn.Conv1d(width, width, 9, stride=2, padding=4),
            nn.ReLU(),
            nn.Conv1d(width, 2 * width, 9, stride=2, padding=4),
            nn.ReLU(),
            nn.AdaptiveAvgPool1d(4),
        )
        self.head = nn.Linear(2 * width * 4, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.flatten(self.features(x), 1))


class CharTransformer(nn.Module):
    """A causal (decoder-only) character-level transformer: token and learned position embeddings,
    ``layers`` pre-norm ``nn.TransformerEncoderLayer`` with a causal mask, a linear head to the
    vocabulary. Input: (batch, time) token ids, time <= ``context``; output: (batch, time, vocab)
    logits for the next character. Dropout is off, so runs are deterministic.
    """

    def __init__(self, vocab_size: int, context: int = 64, d_model: int = 128, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
        self.context = context
        self.embed = nn.Embedding(vocab_size, d_model)
        self.position = nn.Parameter(torch.zeros(context, d_model))
        nn.init.normal_(self.position, std=0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, tokens: Tensor) -> Tensor:
        length = tokens.shape[1]
        if length > self.context:
            raise ValueError(f"sequence of {length} tokens is longer than the context ({self.context})")
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        hidden = self.embed(tokens) + self.position[:length]
        hidden = self.blocks(hidden, mask=mask, is_causal=True)
        return self.head(self.norm(hidden))


MODELS: dict[str, Callable[..., nn.Module]] = {
    "mlp": MLP,
    "smallcnn": SmallCNN,
    "signalcnn": SignalCNN,
    "resnet18": ResNet18,
    "chartransformer": CharTransformer,
}
"""Model constructors by the name configs and the command line use. A task decides which fit its
data and with which arguments (``experiments.tasks``)."""


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
