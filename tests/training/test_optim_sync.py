"""An eager optimiser step reads nothing back to the host, for every optimiser of the
study: each one's CUDA code path (smallbatch.training.optim.build_optimizer with ``cuda=True``:
SGD and LARS on foreach kernels, Adam ``capturable`` + foreach) runs on CPU tensors while
a dispatch mode counts ``aten::item`` / ``aten::_local_scalar_dense`` (what a ``.item()``
or a Python branch on a device tensor becomes: on a GPU, a copy and a synchronisation).
torch's own SGD with the same tensor rate is the positive control: it reads it every step.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from smallbatch.training import optim
from smallbatch.training.models import ContrastiveModel, build_backbone

HOST_READS = {"aten::item", "aten::_local_scalar_dense"}
STEPS = 3


class _HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in HOST_READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def capturable_on_cpu(monkeypatch):
    """torch allows ``capturable`` Adam on accelerators only; let it run on the CPU (the
    code path is the same: the step counter and the rate stay tensors)."""
    import torch.optim.adam as adam

    real = adam._get_capturable_supported_devices
    monkeypatch.setattr(adam, "_get_capturable_supported_devices", lambda *a, **k: [*real(*a, **k), "cpu"])


def _reads_per_step(make) -> float:
    torch.manual_seed(0)
    backbone, feat = build_backbone("small_cnn", 1, 8, width=4)
    model = ContrastiveModel(backbone, feat, 16, 8)
    opt = make(model.parameters(), torch.tensor(0.05))
    x = torch.randn(6, 1, 8, 8)
    counter = _HostReads()
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        optim.set_lr(opt, 0.04)
        with counter:
            optim.optimizer_step(opt)
    return counter.count / STEPS


@pytest.mark.parametrize("name", optim.OPTIMIZERS)
def test_the_cuda_code_path_of_each_optimiser_reads_nothing_back(name, capturable_on_cpu):
    reads = _reads_per_step(lambda params, lr: optim.build_optimizer(params, name, lr, 0.9, 1e-4, cuda=True))
    assert reads == 0


def test_the_counter_sees_torchs_sgd_read_its_tensor_rate():
    reads = _reads_per_step(
        lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4, foreach=True)
    )
    assert reads >= 1


@pytest.mark.parametrize("momentum, weight_decay", [(0.9, 1e-4), (0.0, 0.0), (0.9, 0.0)])
def test_sgd_is_torchs_update_and_state(momentum, weight_decay):
    """The same update as torch.optim.SGD up to rounding (the rate multiplies the buffer
    before the subtraction), the same state, loadable either way."""
    torch.manual_seed(1)
    ps = [torch.randn(5, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)]
    qs = [p.clone() for p in ps]
    mine = optim.SGD(ps, lr=torch.tensor(0.05), momentum=momentum, weight_decay=weight_decay)
    ref = torch.optim.SGD(qs, lr=0.05, momentum=momentum, weight_decay=weight_decay)
    ref.param_groups[0]["lr"] = torch.tensor(0.05).item()  # the float32 rate's value
    for _ in range(4):
        for p, q in zip(ps, qs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        mine.step()
        ref.step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=1e-15, atol=1e-15)
    state = [s.get("momentum_buffer") for s in mine.state_dict()["state"].values()]
    ref_state = [s.get("momentum_buffer") for s in ref.state_dict()["state"].values()]
    assert len(state) == len(ref_state)
    for a, b in zip(state, ref_state):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, rtol=1e-15))
    ref.load_state_dict(mine.state_dict())
