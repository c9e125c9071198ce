"""Backbones and the projection head for contrastive pretraining.

Backbones map a normalised image batch ``(B, C, H, W)`` to features ``(B, F)``:

* ``small_cnn``     -- three conv3x3-BN-ReLU blocks (widths w, 2w, 4w) with 2x2 max-pooling
  after the first two blocks while the map is at least 8 px wide, then average pooling
  to a ``pool_grid`` x ``pool_grid`` grid, flattened (F = 4w * g^2; g = 1 is global
  average pooling). Built for 8x8 digits and 16x16 / 28x28 grayscale images on a CPU.
* ``resnet18_cifar`` / ``resnet50_cifar`` -- torchvision's ResNet-18/50 with the CIFAR
  stem used by SimCLR for 32x32 images (3x3 conv, stride 1, no max-pool), fc removed
  (F = 512 / 2048).
* ``resnet50``      -- torchvision's ImageNet ResNet-50 (7x7 stride-2 stem + max-pool), fc
  removed (F = 2048).

``pool_grid`` (every backbone): the last feature map is average-pooled to g x g cells and
flattened, F = C * g^2. g = 1 (global average pooling) is the ResNets' standard. On
centred, small images the layout carries class information that global pooling throws
away: on Fashion-MNIST at 16 px (10k/2k subsets, one core) a random-init small_cnn
(w = 32) gave 20-NN / linear-probe top-1 77.5 / 80.5 % with g = 1 and 81.0 / 85.1 % with
g = 4 (the whole 4x4 map), against raw pixels' 81.5 / 82.7 %; after 3 epochs of NT-Xent
(batch 64, tau 0.1) 79.1 / 83.1 % with g = 1 and 82.9 / 86.7 % with g = 4.

The projection head is SimCLR's 2-layer MLP (Chen et al., 2020, "A Simple Framework for
Contrastive Learning of Visual Representations"): Linear-BN-ReLU-Linear. Probes (kNN,
linear) read the backbone's features ``h``, never the head's output ``z``.  A method whose
loss declares a predictor (SimSiam, BYOL) adds one more MLP of the same form on ``z``
(``ContrastiveModel.predictor``, trained and saved with the network, never probed).

torchvision is imported lazily inside :func:`build_backbone` (it costs seconds to import).
"""

from __future__ import annotations

import torch
from torch import nn

BACKBONES: tuple[str, ...] = ("small_cnn", "resnet18_cifar", "resnet50_cifar", "resnet50")


class SmallCNN(nn.Module):
    """Three conv3x3-BN-ReLU blocks (w, 2w, 4w channels) + average pooling to a g x g grid.

    A 2x2 max-pool follows block 1 and block 2 when the incoming map is at least 8 px
    wide, so 28 -> 14 -> 7, 16 -> 8 -> 4, 8 -> 4 -> 4 (block 3 always sees >= 4 px for
    inputs >= 8 px). Smaller inputs still work (no pooling), they are just not the target.
    """

    def __init__(self, in_channels: int, image_size: int, width: int = 32, pool_grid: int = 1) -> None:
        super().__init__()
        widths = (width, 2 * width, 4 * width)
        layers: list[nn.Module] = []
        c_in, size = in_channels, image_size
        for i, c_out in enumerate(widths):
            layers += [
                nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=False),
                nn.BatchNorm2d(c_out),
                nn.ReLU(inplace=True),
            ]
            if i < len(widths) - 1 and size >= 8:
                layers.append(nn.MaxPool2d(2))
                size //= 2
            c_in = c_out
        self.features = nn.Sequential(*layers)
        # the last map already at g x g (16 px, g = 4): averaging 1x1 windows is the identity,
        # so skip it (the same numbers; it took ~7 % of a CPU step at batch 256)
        self.pool = nn.Identity() if size == pool_grid else nn.AdaptiveAvgPool2d(pool_grid)
        self.out_dim = widths[-1] * pool_grid * pool_grid
        self.final_map_size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.pool(self.features(x)), 1)


def _check_positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def build_backbone(
    name: str, in_channels: int, image_size: int, width: int = 32, pool_grid: int = 1
) -> tuple[nn.Module, int]:
    """Build a backbone by name; return ``(module, feat_dim)``.

    Args:
        name: one of ``BACKBONES`` (``'small_cnn'``, ``'resnet18_cifar'``,
            ``'resnet50_cifar'``, ``'resnet50'``).
        in_channels: image channels (1 for grayscale, 3 for RGB); the ResNets get a
            new first convolution when it is not 3.
        image_size: input side length in pixels (sets small_cnn's pooling).
        width: small_cnn's base width w (its last map has 4w channels); the ResNets
            keep their standard widths and ignore it.
        pool_grid: the last map is average-pooled to ``pool_grid`` x ``pool_grid`` and
            flattened (1 = global average pooling); F grows by ``pool_grid**2``.

    All weights are randomly initialised (no pretrained download).
    """
    if name not in BACKBONES:
        raise ValueError(f"backbone must be one of {', '.join(BACKBONES)}; got {name!r}")
    _check_positive_int(in_channels, "in_channels")
    _check_positive_int(image_size, "image_size")
    _check_positive_int(width, "width")
    _check_positive_int(pool_grid, "pool_grid")

    if name == "small_cnn":
        net = SmallCNN(in_channels, image_size, width, pool_grid)
        return net, net.out_dim

    import torchvision  # lazy: ~4 s import

    if name in ("resnet18_cifar", "resnet50_cifar"):
        ctor = torchvision.models.resnet18 if name == "resnet18_cifar" else torchvision.models.resnet50
        net = ctor(weights=None)
        # SimCLR's CIFAR variant: 3x3 stride-1 stem, no max-pool.
        net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    else:  # resnet50 (ImageNet stem)
        net = torchvision.models.resnet50(weights=None)
        if in_channels != 3:
            net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
    feat_dim = net.fc.in_features * pool_grid * pool_grid
    net.avgpool = nn.AdaptiveAvgPool2d(pool_grid)  # torchvision flattens after avgpool
    net.fc = nn.Identity()
    return net, feat_dim


class ProjectionHead(nn.Module):
    """SimCLR's projection head g(h): Linear -> BatchNorm1d -> ReLU -> Linear.

    Chen et al. (2020), SimCLR, Sec. 2.1: z = W2 ReLU(BN(W1 h)). The first linear layer
    has no bias because BatchNorm follows it.
    """

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int) -> None:
        super().__init__()
        _check_positive_int(in_dim, "in_dim")
        _check_positive_int(hidden_dim, "hidden_dim")
        _check_positive_int(out_dim, "out_dim")
        self.net = nn.Sequential(
            nn.Linear(in_dim, hidden_dim, bias=False),
            nn.BatchNorm1d(hidden_dim),
            nn.ReLU(inplace=True),
            nn.Linear(hidden_dim, out_dim),
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.net(h)


class ContrastiveModel(nn.Module):
    """Backbone f + projection head g: ``forward(x) = g(f(x))`` (projections z),
    ``features(x) = f(x)`` (the representation the probes evaluate).  With ``pred_hidden``, a
    predictor q on the projections too (SimSiam's and BYOL's: Linear-BN-ReLU-Linear with that
    hidden width, back to ``proj_dim``): ``predict(z) = q(z)``; registered after the backbone
    and the head, so the first parameters are always those of f and g."""

    def __init__(
        self, backbone: nn.Module, feat_dim: int, proj_hidden: int, proj_dim: int, pred_hidden: int | None = None
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = ProjectionHead(feat_dim, proj_hidden, proj_dim)
        self.feat_dim = feat_dim
        self.proj_dim = proj_dim
        if pred_hidden is not None:
            self.predictor = ProjectionHead(proj_dim, pred_hidden, proj_dim)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Backbone features h = f(x), shape (B, feat_dim)."""
        return self.backbone(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Projections z = g(f(x)), shape (B, proj_dim)."""
        return self.head(self.backbone(x))

    def predict(self, z: torch.Tensor) -> torch.Tensor:
        """The predictor's output q(z) of projections ``z`` (a model built with ``pred_hidden``)."""
        return self.predictor(z)

    def forward_both(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, z) from a single backbone pass."""
        h = self.backbone(x)
        return h, self.head(h)


def count_parameters(module: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters in ``module`` (only those with ``requires_grad`` if asked)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)
