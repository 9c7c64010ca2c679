"""`hpcfed.tasks.adam.Adam` and `hpcfed.tasks.sgd.SGD` are torch's Adam/AdamW and SGD (with momentum) to
the bit, save and load in torch's layout, refuse another optimizer's state, and (their reason to exist)
train without importing the compiler, `torch._dynamo`; the quickstart takes SGD with ``task.optimizer:
sgd`` and refuses settings that do not fit it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpcfed.tasks import torch_state
from hpcfed.tasks.adam import Adam
from hpcfed.tasks.sgd import SGD

torch = pytest.importorskip("torch")


def _model(dtype: object) -> object:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).to(dtype)


def _train(model: object, optimizer: object, steps: range, dtype: object) -> None:
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 6, generator=gen).to(dtype), torch.randint(0, 3, (4,), generator=gen))
               for _ in range(max(steps) + 1)]
    for i in steps:
        x, y = batches[i]
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x).float(), y).backward()
        optimizer.step()


def _same(a: object, b: object) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize(("decoupled", "weight_decay", "dtype"), [
    (False, 0.0, "float32"), (False, 1e-2, "float32"), (True, 1e-2, "float32"), (False, 0.0, "bfloat16")])
def test_steps_equal_torchs_bit_for_bit(decoupled: bool, weight_decay: float, dtype: str) -> None:
    dt = getattr(torch, dtype)
    ours, theirs = _model(dt), _model(dt)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    _train(ours, Adam(ours.parameters(), lr=0.01, weight_decay=weight_decay, decoupled_weight_decay=decoupled),
           range(12), dt)
    _train(theirs, cls(theirs.parameters(), lr=0.01, weight_decay=weight_decay), range(12), dt)
    assert _same(ours, theirs)
    assert not _same(ours, _model(dt))  # it trained


# each optimizer: (ours, torch's, the settings it trains with); the saved lr (0.01) wins over the 0.5 given
# to the optimizer a state is loaded into, as in torch
OPTIMIZERS = {"adam": (Adam, lambda: torch.optim.Adam, {"weight_decay": 1e-3}),
              "sgd": (SGD, lambda: torch.optim.SGD, {"momentum": 0.9})}


@pytest.mark.parametrize("kind", ["adam", "sgd"])
@pytest.mark.parametrize("saver", ["ours", "torch"])
def test_a_saved_state_resumes_in_either_class(kind: str, saver: str) -> None:
    """Train 5 steps, save through torch_state (as a checkpoint does), load into a fresh optimizer of
    the other class, train 5 more: the same model as 10 steps without a stop (moments, momentum buffers)."""
    ours, theirs, settings = OPTIMIZERS[kind][0], OPTIMIZERS[kind][1](), OPTIMIZERS[kind][2]
    dt = torch.float32
    straight = _model(dt)
    _train(straight, theirs(straight.parameters(), lr=0.01, **settings), range(10), dt)

    first = _model(dt)
    opt1 = (ours if saver == "ours" else theirs)(first.parameters(), lr=0.01, **settings)
    _train(first, opt1, range(5), dt)
    header, arrays = torch_state.optimizer_state(opt1)
    second = _model(dt)
    second.load_state_dict(first.state_dict())
    opt2 = (theirs if saver == "ours" else ours)(second.parameters(), lr=0.5, **settings)
    torch_state.load_optimizer_state(opt2, header, arrays)
    _train(second, opt2, range(5, 10), dt)
    assert _same(second, straight)


def test_a_state_for_other_parameters_is_refused() -> None:
    model = _model(torch.float32)
    opt = Adam(model.parameters(), lr=0.01)
    other = Adam(list(model.parameters())[:2], lr=0.01)
    with pytest.raises(ValueError, match="does not fit 4 parameters"):
        opt.load_state_dict(other.state_dict())


@pytest.mark.parametrize("cls", ["Adam", "SGD"])
def test_training_does_not_import_the_compiler(cls: str) -> None:
    """torch.optim's classes import torch._dynamo when built (seconds of CPU on every client rank); these do not."""
    module = {"Adam": "adam", "SGD": "sgd"}[cls]
    code = f"""
import sys, torch
from hpcfed.tasks.{module} import {cls}
m = torch.nn.Linear(3, 2)
opt = {cls}(m.parameters(), lr=0.1)
for _ in range(2):
    opt.zero_grad(); m(torch.ones(4, 3)).sum().backward(); opt.step()
print("torch._dynamo" in sys.modules)
torch.optim.{cls}(m.parameters(), lr=0.1)
print("torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["False", "True"]  # the second line: the check itself can see the import


@pytest.mark.parametrize(("momentum", "weight_decay", "dtype"), [
    (0.0, 0.0, "float32"), (0.9, 0.0, "float32"), (0.9, 1e-2, "float32"), (0.5, 0.0, "bfloat16")])
def test_sgd_steps_equal_torchs_bit_for_bit(momentum: float, weight_decay: float, dtype: str) -> None:
    dt = getattr(torch, dtype)
    ours, theirs = _model(dt), _model(dt)
    _train(ours, SGD(ours.parameters(), lr=0.1, momentum=momentum, weight_decay=weight_decay), range(12), dt)
    _train(theirs, torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=momentum, weight_decay=weight_decay),
           range(12), dt)
    assert _same(ours, theirs)
    assert not _same(ours, _model(dt))  # it trained


def test_sgd_refuses_another_optimizers_state_and_bad_settings() -> None:
    model = _model(torch.float32)
    adam = Adam(model.parameters(), lr=0.01)
    _train(model, adam, range(2), torch.float32)
    with pytest.raises(ValueError, match="not SGD's"):
        SGD(model.parameters(), lr=0.1, momentum=0.9).load_state_dict(adam.state_dict())
    with pytest.raises(ValueError, match="does not fit 4 parameters"):
        SGD(model.parameters(), lr=0.1).load_state_dict(SGD(list(model.parameters())[:2], lr=0.1).state_dict())
    for lr, momentum in ((0.0, 0.0), (0.1, 1.0), (0.1, -0.1)):
        with pytest.raises(ValueError, match="lr > 0 and 0 <= momentum < 1"):
            SGD(model.parameters(), lr=lr, momentum=momentum)


def _quickstart(tmp_path: Path, **config: object) -> object:
    from hpcfed.tasks.base import Site
    from hpcfed.tasks.synthetic import SyntheticTask

    return SyntheticTask(SyntheticTask.Config(samples_per_site=64, **config),
                         Site(client_id=0, num_clients=2, seed=0, out_dir=tmp_path))


def test_the_quickstart_trains_with_sgd_and_momentum_and_resumes_it(tmp_path: Path) -> None:
    """``task.optimizer: sgd``: the site's steps are SGD's, its momentum buffers ride in the task's state,
    and a site restored from that state trains on as the uninterrupted one."""
    straight = _quickstart(tmp_path, optimizer="sgd", momentum=0.9, lr=0.05)
    assert isinstance(straight.optimizer, SGD)
    start = straight.get_parameters()
    straight.fit(0)
    state = straight.state_dict()
    assert any(k.endswith("momentum_buffer") for k in state[1])
    resumed = _quickstart(tmp_path, optimizer="sgd", momentum=0.9, lr=0.05)
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
