"""The quickstart's MLP in NumPy (`hpcfed.tasks.synthetic_numpy`): the same network and Adam as
torch's, to float32 rounding; exact resume; hostile state refused; no torch on its site."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from conftest import REPO

from hpcfed.tasks.base import Site
from hpcfed.tasks.synthetic_numpy import SyntheticNumpyTask, loss_and_gradients


def _task(tmp_path, client_id=0, **options) -> SyntheticNumpyTask:
    config = replace(SyntheticNumpyTask.Config(samples_per_site=200), **options)
    return SyntheticNumpyTask(config, Site(client_id=client_id, num_clients=2, seed=3, out_dir=tmp_path))


def _torch_twin(task: SyntheticNumpyTask):
    """The quickstart's network (tasks/synthetic.py) holding the NumPy task's parameters."""
    torch = pytest.importorskip("torch")
    c = task.config
    nn = torch.nn
    encoder = nn.Sequential(nn.Linear(c.dim, c.hidden), nn.ReLU(), nn.Linear(c.hidden, c.embed_dim))
    model = nn.Sequential(encoder, nn.ReLU(), nn.Linear(c.embed_dim, c.num_classes))
    model.load_state_dict({k: torch.as_tensor(v) for k, v in task.get_parameters().items()})
    return torch, model


def test_the_parameters_carry_the_quickstarts_names_and_shapes(tmp_path):
    from hpcfed.tasks.synthetic import SyntheticTask

    torch = pytest.importorskip("torch")
    torch_site = SyntheticTask(SyntheticTask.Config(samples_per_site=200), Site(client_id=0, num_clients=2, seed=3,
                                                                              out_dir=tmp_path))
    ours = _task(tmp_path).get_parameters()
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in torch_site.get_parameters().items()}
    assert all(v.dtype == np.float32 for v in ours.values()) and torch is not None


def test_gradients_equal_torch_autograd(tmp_path):
    task = _task(tmp_path)
    torch, model = _torch_twin(task)
    x, y = task.data["x_train"][:32], task.data["y_train"][:32]
    loss, grads = loss_and_gradients(task.params, x, y)
    expected = torch.nn.functional.cross_entropy(model(torch.as_tensor(x)), torch.as_tensor(y))
    expected.backward()
    assert loss == pytest.approx(expected.detach().item(), rel=1e-5)
    for name, param in model.named_parameters():
        np.testing.assert_allclose(grads[name], param.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)


def test_a_round_of_adam_follows_torch_optim_adam_on_the_same_batches(tmp_path):
    task = _task(tmp_path, local_epochs=2)
    torch, model = _torch_twin(task)
    optimizer = torch.optim.Adam(model.parameters(), lr=task.config.lr)
    x, y = torch.as_tensor(task.data["x_train"]), torch.as_tensor(task.data["y_train"])
    order_rng = np.random.default_rng(np.random.SeedSequence([3, 0, 5]))  # fit(5)'s draws on site 0, seed 3
    for _ in range(2):
        order = order_rng.permutation(len(x))
        for start in range(0, len(x), 32):
            idx = torch.as_tensor(order[start : start + 32])
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            optimizer.step()
    task.fit(5)
    for name, value in model.state_dict().items():
        np.testing.assert_allclose(task.params[name], value.numpy(), rtol=1e-4, atol=2e-5, err_msg=name)


def test_training_learns_and_the_final_metrics_are_on_the_balanced_test_split(tmp_path):
    task = _task(tmp_path, samples_per_site=400)
    before = task.evaluate(0, final=True)["accuracy"]
    for rnd in range(8):
        task.fit(rnd)
    final = task.evaluate(8, final=True)
    assert final["accuracy"] > before + 0.15 and set(final) == {"loss", "accuracy", "macro_f1"}
    assert len(task.data["y_test"]) == 200 and set(task.evaluate(8)) == {"val_loss", "val_accuracy"}


def test_a_resumed_site_repeats_the_uninterrupted_one_bit_for_bit(tmp_path):
    straight = _task(tmp_path)
    straight.fit(0)
    straight.fit(1)
    first = _task(tmp_path)
    first.fit(0)
    params, state = first.get_parameters(), first.state_dict()
    resumed = _task(tmp_path)
    resumed.set_parameters(params)
    resumed.load_state_dict(state)
    resumed.fit(1)
    for key, value in straight.params.items():
        assert np.array_equal(value, resumed.params[key]), key


@pytest.mark.parametrize("break_state, message", [
    (lambda h, a: h.update(adam_step=-1), "adam_step must be a count >= 0, got -1"),
    (lambda h, a: h.update(adam_step="7"), "adam_step must be a count >= 0, got '7'"),
    (lambda h, a: a.pop("exp_avg/2.bias"), "exp_avg/2.bias is missing or not of shape (8,)"),
    (lambda h, a: a.update({"exp_avg_sq/0.0.weight": np.zeros((2, 2))}), "exp_avg_sq/0.0.weight is missing"),
])
def test_a_hostile_or_damaged_state_is_refused_naming_the_entry(tmp_path, break_state, message):
    site = _task(tmp_path)
    site.fit(0)
    header, arrays = site.state_dict()
    header, arrays = dict(header), dict(arrays)
    break_state(header, arrays)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _task(tmp_path).load_state_dict((header, arrays))


def test_parameters_of_another_shape_are_refused_naming_the_parameter(tmp_path):
    site = _task(tmp_path)
    params = site.get_parameters()
    params["0.2.weight"] = np.zeros((3, 3), np.float32)
    with pytest.raises(ValueError, match=r"parameter 0.2.weight: shape \(3, 3\), the model's is \(16, 64\)"):
        site.set_parameters(params)


def test_its_site_never_imports_torch(tmp_path):
    code = (
        "import sys\nfrom pathlib import Path\n"
        "from hpcfed.tasks.base import Site\nfrom hpcfed.tasks.synthetic_numpy import SyntheticNumpyTask as T\n"
        f"site = Site(client_id=1, num_clients=2, seed=0, out_dir=Path({str(tmp_path)!r}))\n"
        "t = T(T.Config(samples_per_site=100), site)\n"
        "t.set_parameters(t.get_parameters()); t.fit(0); t.evaluate(0, final=True); t.load_state_dict(t.state_dict())\n"
        f"print(t.export_embeddings(Path({str(tmp_path)!r})))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(".h5")


def test_the_ballast_travels_untrained_and_leaves_the_network_alone(tmp_path):
    plain, heavy = _task(tmp_path), _task(tmp_path, ballast=1000)
    assert heavy.get_parameters()["ballast"].shape == (1000,) and "ballast" not in plain.get_parameters()
    plain.fit(0)
    heavy.fit(0)
    assert not heavy.params["ballast"].any()
    assert all(np.array_equal(v, heavy.params[k]) for k, v in plain.params.items())


@pytest.mark.parametrize("override, message", [
    ("privacy.record_dp.epsilon=8", "task 'synthetic_numpy' cannot take record-level DP: its NumPy network"),
    ("federation.ranks_per_site=2", "task 'synthetic_numpy' trains on one rank per site"),
])
def test_what_needs_torch_is_refused_in_one_line_naming_the_key(override, message):
    from hpcfed.config import ConfigError, load
    from hpcfed.registry import resolve

    with pytest.raises(ConfigError, match=message):
        resolve(load(REPO / "configs" / "quickstart.yaml", ["task.name=synthetic_numpy", override]))
