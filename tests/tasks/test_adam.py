"""`hpcfed.tasks.adam.Adam` is torch's Adam/AdamW to the bit, saves and loads in torch's layout, and
(its reason to exist) trains without importing the compiler, `torch._dynamo`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hpcfed.tasks import torch_state
from hpcfed.tasks.adam import Adam

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


@pytest.mark.parametrize("saver", ["ours", "torch"])
def test_a_saved_state_resumes_in_either_class(saver: str) -> None:
    """Train 5 steps, save through torch_state (as a checkpoint does), load into a fresh optimizer of
    the other class, train 5 more: the same model as 10 steps without a stop."""
    dt = torch.float32
    straight = _model(dt)
    _train(straight, torch.optim.Adam(straight.parameters(), lr=0.01, weight_decay=1e-3), range(10), dt)

    first = _model(dt)
    opt1 = (Adam(first.parameters(), lr=0.01, weight_decay=1e-3) if saver == "ours"
            else torch.optim.Adam(first.parameters(), lr=0.01, weight_decay=1e-3))
    _train(first, opt1, range(5), dt)
    header, arrays = torch_state.optimizer_state(opt1)
    second = _model(dt)
    second.load_state_dict(first.state_dict())
    opt2 = (torch.optim.Adam(second.parameters(), lr=0.5) if saver == "ours"
            else Adam(second.parameters(), lr=0.5))  # the saved lr (0.01) wins, as in torch
    torch_state.load_optimizer_state(opt2, header, arrays)
    _train(second, opt2, range(5, 10), dt)
    assert _same(second, straight)


def test_a_state_for_other_parameters_is_refused() -> None:
    model = _model(torch.float32)
    opt = Adam(model.parameters(), lr=0.01)
    other = Adam(list(model.parameters())[:2], lr=0.01)
    with pytest.raises(ValueError, match="does not fit 4 parameters"):
        opt.load_state_dict(other.state_dict())


def test_training_does_not_import_the_compiler() -> None:
    """torch.optim.Adam imports torch._dynamo when built (seconds of CPU on every client rank); this one does not."""
    code = """
import sys, torch
from hpcfed.tasks.adam import Adam
m = torch.nn.Linear(3, 2)
opt = Adam(m.parameters(), lr=0.1)
for _ in range(2):
    opt.zero_grad(); m(torch.ones(4, 3)).sum().backward(); opt.step()
print("torch._dynamo" in sys.modules)
torch.optim.Adam(m.parameters(), lr=0.1)
print("torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["False", "True"]  # the second line: the check itself can see the import
