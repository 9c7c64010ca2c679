"""`hpcfed.tasks.sgd.SGD` is torch's SGD (with momentum) to the bit, saves and loads in torch's layout,
refuses another optimizer's state, and trains without importing the compiler; the quickstart takes it
with ``task.optimizer: sgd`` and refuses the settings that do not fit it."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hpcfed.tasks import torch_state
from hpcfed.tasks.adam import Adam
from hpcfed.tasks.sgd import SGD

torch = pytest.importorskip("torch")


def _model(dtype: object = None) -> object:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).to(
        dtype or torch.float32)


def _train(model: object, optimizer: object, steps: range) -> None:
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 6, generator=gen).to(next(model.parameters()).dtype),
                torch.randint(0, 3, (4,), generator=gen)) for _ in range(max(steps) + 1)]
    for i in steps:
        x, y = batches[i]
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x).float(), y).backward()
        optimizer.step()


def _same(a: object, b: object) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize(("momentum", "weight_decay", "dtype"), [
    (0.0, 0.0, "float32"), (0.9, 0.0, "float32"), (0.9, 1e-2, "float32"), (0.5, 0.0, "bfloat16")])
def test_steps_equal_torchs_bit_for_bit(momentum: float, weight_decay: float, dtype: str) -> None:
    dt = getattr(torch, dtype)
    ours, theirs = _model(dt), _model(dt)
    _train(ours, SGD(ours.parameters(), lr=0.1, momentum=momentum, weight_decay=weight_decay), range(12))
    _train(theirs, torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=momentum, weight_decay=weight_decay),
           range(12))
    assert _same(ours, theirs)
    assert not _same(ours, _model(dt))  # it trained


@pytest.mark.parametrize("saver", ["ours", "torch"])
def test_a_saved_state_resumes_in_either_class(saver: str) -> None:
    """5 steps, save through torch_state (as a checkpoint does), load into a fresh optimizer of the other
    class, 5 more: the same model as 10 steps without a stop (the momentum buffers came back)."""
    straight = _model()
    _train(straight, torch.optim.SGD(straight.parameters(), lr=0.1, momentum=0.9), range(10))

    first = _model()
    opt1 = (SGD(first.parameters(), lr=0.1, momentum=0.9) if saver == "ours"
            else torch.optim.SGD(first.parameters(), lr=0.1, momentum=0.9))
    _train(first, opt1, range(5))
    header, arrays = torch_state.optimizer_state(opt1)
    second = _model()
    second.load_state_dict(first.state_dict())
    opt2 = (torch.optim.SGD(second.parameters(), lr=0.5, momentum=0.9) if saver == "ours"
            else SGD(second.parameters(), lr=0.5, momentum=0.9))  # the saved lr (0.1) wins, as in torch
    torch_state.load_optimizer_state(opt2, header, arrays)
    _train(second, opt2, range(5, 10))
    assert _same(second, straight)


def test_another_optimizers_state_and_bad_settings_are_refused() -> None:
    model = _model()
    adam = Adam(model.parameters(), lr=0.01)
    _train(model, adam, range(2))
    with pytest.raises(ValueError, match="not SGD's"):
        SGD(model.parameters(), lr=0.1, momentum=0.9).load_state_dict(adam.state_dict())
    with pytest.raises(ValueError, match="does not fit 4 parameters"):
        SGD(model.parameters(), lr=0.1).load_state_dict(SGD(list(model.parameters())[:2], lr=0.1).state_dict())
    for lr, momentum in ((0.0, 0.0), (0.1, 1.0), (0.1, -0.1)):
        with pytest.raises(ValueError, match="lr > 0 and 0 <= momentum < 1"):
            SGD(model.parameters(), lr=lr, momentum=momentum)


def test_training_does_not_import_the_compiler() -> None:
    code = """
import sys, torch
from hpcfed.tasks.sgd import SGD
m = torch.nn.Linear(3, 2)
opt = SGD(m.parameters(), lr=0.1, momentum=0.9)
for _ in range(2):
    opt.zero_grad(); m(torch.ones(4, 3)).sum().backward(); opt.step()
print("torch._dynamo" in sys.modules)
torch.optim.SGD(m.parameters(), lr=0.1)
print("torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["False", "True"]  # the second line: the check itself can see the import


def _quickstart(**config: object) -> object:
    from hpcfed.tasks.base import Site
    from hpcfed.tasks.synthetic import SyntheticTask

    return SyntheticTask(SyntheticTask.Config(samples_per_site=64, **config),
                         Site(client_id=0, num_clients=2, seed=0, out_dir=Path(tempfile.mkdtemp())))


def test_the_quickstart_trains_with_sgd_and_momentum_and_resumes_it() -> None:
    """``task.optimizer: sgd``: the site's steps are SGD's (its momentum buffers in the task's state), and a
    site restored from that state trains on as the uninterrupted one."""
    straight = _quickstart(optimizer="sgd", momentum=0.9, lr=0.05)
    assert isinstance(straight.optimizer, SGD)
    start = straight.get_parameters()
    straight.fit(0)
    state = straight.state_dict()
    assert any(k.endswith("momentum_buffer") for k in state[1])
    resumed = _quickstart(optimizer="sgd", momentum=0.9, lr=0.05)
    resumed.set_parameters(straight.get_parameters())
    resumed.load_state_dict(state)
    straight.fit(1)
    resumed.fit(1)
    assert all((straight.get_parameters()[k] == resumed.get_parameters()[k]).all() for k in start)
    assert any((straight.get_parameters()[k] != start[k]).any() for k in start)


@pytest.mark.parametrize(("config", "match"), [
    ({"optimizer": "rmsprop"}, "choose adam or sgd"),
    ({"optimizer": "adam", "momentum": 0.9}, "for optimizer sgd only"),
    ({"optimizer": "sgd", "momentum": 1.0}, "momentum must be in"),
    ({"optimizer": "sgd", "lr": 0.0}, "lr must be > 0"),
])
def test_the_quickstart_refuses_optimizer_settings_that_do_not_fit(config: dict, match: str) -> None:
    from hpcfed.tasks.synthetic import SyntheticTask

    with pytest.raises(ValueError, match=match):
        SyntheticTask.Config(**config).validate()
