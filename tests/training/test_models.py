from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from smallbatch.training.models import (
    BACKBONES,
    ContrastiveModel,
    ProjectionHead,
    build_backbone,
    count_parameters,
)


@pytest.mark.parametrize("size", [8, 16, 28])
@pytest.mark.parametrize("channels", [1, 3])
def test_small_cnn_shapes(size: int, channels: int) -> None:
    torch.manual_seed(0)
    net, feat = build_backbone("small_cnn", channels, size, width=32)
    assert feat == 128
    out = net(torch.randn(4, channels, size, size))
    assert out.shape == (4, 128)
    assert torch.isfinite(out).all()


def test_small_cnn_pooling_adapts_to_size() -> None:
    assert build_backbone("small_cnn", 1, 28)[0].final_map_size == 7
    assert build_backbone("small_cnn", 1, 16)[0].final_map_size == 4
    assert build_backbone("small_cnn", 1, 8)[0].final_map_size == 4


def test_small_cnn_width_sets_feature_dim() -> None:
    net, feat = build_backbone("small_cnn", 1, 16, width=8)
    assert feat == 32
    assert net(torch.randn(2, 1, 16, 16)).shape == (2, 32)


def test_pool_grid_keeps_the_map_layout() -> None:
    torch.manual_seed(0)
    net, feat = build_backbone("small_cnn", 1, 16, width=8, pool_grid=4)
    assert feat == 32 * 16
    net.eval()
    x = torch.randn(3, 1, 16, 16)
    fmap = net.features(x)  # (3, 32, 4, 4): g = 4 is the whole map, channel-major
    torch.testing.assert_close(net(x), fmap.flatten(1))
    g1, _ = build_backbone("small_cnn", 1, 16, width=8, pool_grid=1)
    g1.load_state_dict(net.state_dict())  # same parameters: the grid only changes pooling
    torch.testing.assert_close(g1.eval()(x), fmap.mean((2, 3)))
    # 28 px -> 7x7 map: g = 2 averages overlapping cells of it
    net28, feat28 = build_backbone("small_cnn", 1, 28, width=8, pool_grid=2)
    assert feat28 == 32 * 4 and net28(torch.randn(2, 1, 28, 28)).shape == (2, 128)


def test_pool_grid_on_a_resnet() -> None:
    net, feat = build_backbone("resnet18_cifar", 3, 32, pool_grid=2)
    assert feat == 512 * 4
    assert net.eval()(torch.randn(2, 3, 32, 32)).shape == (2, feat)


@pytest.mark.parametrize("name,feat_dim", [("resnet18_cifar", 512), ("resnet50_cifar", 2048)])
@pytest.mark.parametrize("channels", [1, 3])
def test_cifar_resnets(name: str, feat_dim: int, channels: int) -> None:
    torch.manual_seed(0)
    net, feat = build_backbone(name, channels, 32)
    assert feat == feat_dim
    # CIFAR stem: 3x3 stride 1, no max-pool
    assert net.conv1.kernel_size == (3, 3) and net.conv1.stride == (1, 1)
    assert net.conv1.in_channels == channels
    assert isinstance(net.maxpool, nn.Identity) and isinstance(net.fc, nn.Identity)
    net.eval()
    with torch.no_grad():
        out = net(torch.randn(2, channels, 32, 32))
    assert out.shape == (2, feat_dim)


@pytest.mark.parametrize("channels", [1, 3])
def test_imagenet_resnet50(channels: int) -> None:
    torch.manual_seed(0)
    net, feat = build_backbone("resnet50", channels, 64)
    assert feat == 2048
    assert net.conv1.kernel_size == (7, 7) and net.conv1.stride == (2, 2)
    assert net.conv1.in_channels == channels
    assert isinstance(net.maxpool, nn.MaxPool2d)
    net.eval()
    with torch.no_grad():
        out = net(torch.randn(2, channels, 64, 64))
    assert out.shape == (2, 2048)


def test_unknown_backbone_names_allowed() -> None:
    with pytest.raises(ValueError, match="backbone must be one of small_cnn, resnet18_cifar"):
        build_backbone("vgg", 3, 32)


@pytest.mark.parametrize(
    "kwargs,arg",
    [
        (dict(in_channels=0, image_size=16), "in_channels"),
        (dict(in_channels=1, image_size=0), "image_size"),
        (dict(in_channels=1, image_size=16, width=0), "width"),
        (dict(in_channels=1, image_size=16, pool_grid=0), "pool_grid"),
        (dict(in_channels=1.5, image_size=16), "in_channels"),
    ],
)
def test_bad_backbone_arguments(kwargs: dict, arg: str) -> None:
    with pytest.raises(ValueError, match=arg):
        build_backbone("small_cnn", **kwargs)


def test_projection_head_structure_and_shape() -> None:
    head = ProjectionHead(128, 64, 32)
    kinds = [type(m) for m in head.net]
    assert kinds == [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear]
    assert head(torch.randn(5, 128)).shape == (5, 32)
    with pytest.raises(ValueError, match="hidden_dim"):
        ProjectionHead(128, 0, 32)


def test_contrastive_model_features_vs_projections() -> None:
    torch.manual_seed(0)
    bb, feat = build_backbone("small_cnn", 1, 16, width=8)
    model = ContrastiveModel(bb, feat, 64, 16).eval()
    x = torch.randn(3, 1, 16, 16)
    h, z = model.forward_both(x)
    assert h.shape == (3, feat) and z.shape == (3, 16)
    torch.testing.assert_close(model.features(x), h)
    torch.testing.assert_close(model(x), z)
    torch.testing.assert_close(model.head(h), z)
    # gradients from the projection reach the backbone
    model.train()
    model(torch.randn(4, 1, 16, 16)).pow(2).sum().backward()
    assert all(p.grad is not None for p in model.backbone.parameters())


def test_count_parameters() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))  # 16 + 10
    assert count_parameters(net) == 26
    net[0].weight.requires_grad_(False)
    assert count_parameters(net) == 26
    assert count_parameters(net, trainable_only=True) == 14
    bb, feat = build_backbone("small_cnn", 1, 16, width=32)
    # conv: 1*32*9 + 32*64*9 + 64*128*9 ; BN: 2*(32+64+128)
    assert count_parameters(bb) == 288 + 18432 + 73728 + 448


def test_all_backbones_listed() -> None:
    assert BACKBONES == ("small_cnn", "resnet18_cifar", "resnet50_cifar", "resnet50")


def test_importing_models_does_not_import_torchvision() -> None:
    code = "import sys, smallbatch.training.models; sys.exit('torchvision' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
