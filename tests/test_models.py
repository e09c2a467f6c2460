"""The experiments' models: their documented sizes and shapes, and the language model's causality."""

from __future__ import annotations

import pytest
import torch

from gradcomp.experiments import models


def test_benchmark_mlp_has_the_documented_size() -> None:
    assert models.parameter_count(models.MLP(1024, [2048, 2048], 10)) == 6_316_042


def test_resnet18_is_the_cifar_variant() -> None:
    net = models.ResNet18()
    assert models.parameter_count(net) == 11_173_962
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert models.ResNet18(num_classes=7, in_channels=1)(torch.randn(1, 1, 16, 16)).shape == (1, 7)


def test_small_models_fit_their_tasks() -> None:
    assert models.SmallCNN()(torch.randn(3, 1, 8, 8)).shape == (3, 10)
    assert models.SignalCNN()(torch.randn(3, 1, 128)).shape == (3, 10)
    assert set(models.MODELS) >= {"mlp", "resnet18", "smallcnn", "signalcnn", "chartransformer"}


def test_char_transformer_is_causal() -> None:
    torch.manual_seed(0)
    net = models.CharTransformer(vocab_size=30, context=16, d_model=32, heads=4, layers=2)
    tokens = torch.randint(0, 30, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 30
    before, after = net(tokens), net(changed)
    assert before.shape == (2, 16, 30)
    assert torch.equal(before[:, :10], after[:, :10])  # the past never sees the future
    assert not torch.allclose(before[:, 10:], after[:, 10:])
    with pytest.raises(ValueError, match="longer than the context"):
        net(torch.zeros(1, 17, dtype=torch.long))
