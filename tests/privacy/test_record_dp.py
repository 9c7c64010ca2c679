"""Record-level DP: the accountant against Opacus's, the noise calibrated to a target, per-example
clipping against one example whose gradient is 1e6 x the others', the plan's and the config's refusals,
the accountant's state across a resume, and a site that stops at its budget."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from hpcfed.config import ConfigError, RecordDPConfig, from_mapping
from hpcfed.privacy import record_dp as R
from hpcfed.privacy.dp_sgd import DPSGD, poisson_batch, round_generator
from hpcfed.registry import resolve
from hpcfed.tasks.base import Site
from hpcfed.tasks.synthetic import SyntheticTask
from hpcfed.tasks.torch_adapter import TorchTask


def test_epsilon_matches_opacus_rdp_accountant_for_a_hand_set_case():
    opacus = pytest.importorskip("opacus.accountants")
    acc = opacus.RDPAccountant()
    acc.history = [(1.1, 0.01, 1000)]  # z, q, steps: the composition Opacus's MNIST example counts
    theirs = acc.get_epsilon(1e-5)
    ours = R.epsilon(1.1, 0.01, 1000, 1e-5)
    assert ours == pytest.approx(theirs, rel=0.03)  # the same RDP bound over other orders
    assert 0 < ours < 5


def test_noise_for_a_target_spends_it_over_the_whole_run_and_no_more():
    z = R.noise_for(2.0, 1e-5, 0.05, 300)
    assert R.epsilon(z, 0.05, 300, 1e-5) <= 2.0 + 1e-6
    assert R.epsilon(z * 0.97, 0.05, 300, 1e-5) > 2.0  # the smallest such z, within its tolerance
    assert R.epsilon(z, 0.05, 0, 1e-5) == 0.0


def _plan(**kw) -> R.Plan:
    base = {"records": 10, "sample_rate": 0.5, "noise_multiplier": 1.0, "clip_norm": 1.0, "delta": 1e-5,
            "target_epsilon": 8.0, "steps_per_round": 1}
    return R.Plan(**{**base, **kw})


def test_per_example_clipping_bounds_one_huge_example():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    sgd = DPSGD(model, lambda x, y: torch.nn.functional.cross_entropy(model(x), y), _plan(clip_norm=0.5))
    x, y = torch.randn(6, 3), torch.tensor([0, 1, 0, 1, 0, 1])
    huge = x.clone()
    huge[0] *= 1e6
    grads = sgd.per_example_grads(huge, y)
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads))
    assert norms[0] > 1e4 * norms[1:].max()  # the raw gradient of example 0 dwarfs the others
    # per-example gradients are each example's own autograd gradient
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(huge[1:2]), y[1:2]).backward()
    assert torch.allclose(grads[0][1], model.weight.grad, rtol=1e-4, atol=1e-6)
    with_it = torch.cat([s.flatten() for s in sgd.clipped_sum(grads)])
    without = torch.cat([s.flatten() for s in sgd.clipped_sum([g[1:] for g in grads])])
    assert float(torch.linalg.vector_norm(with_it - without)) <= 0.5 * (1 + 1e-5)


def test_noisy_grad_is_reproducible_from_the_secret_seed_and_round():
    model = torch.nn.Linear(3, 2)
    sgd = DPSGD(model, lambda x, y: torch.nn.functional.cross_entropy(model(x), y), _plan())
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    grads = []
    for seed, rnd in ((7, 0), (7, 0), (8, 0), (7, 1)):
        sgd.set_noisy_grad(x, y, 4, round_generator(seed, 0, rnd))
        grads.append(model.weight.grad.clone())
    assert torch.equal(grads[0], grads[1])
    assert not torch.equal(grads[0], grads[2]) and not torch.equal(grads[0], grads[3])
    idx = poisson_batch(10_000, 0.1, round_generator(1, 0, 0))
    assert 800 < len(idx) < 1200 and len(set(idx.tolist())) == len(idx)


def test_plan_default_delta_and_refuses_a_delta_at_one_over_n():
    settings = RecordDPConfig(epsilon=4.0)
    p = R.plan(settings, client_id=0, records=500, batch_size=50, steps_per_round=10, rounds=5)
    assert p.delta == 1e-5 and p.sample_rate == 0.1
    assert R.plan(settings, client_id=0, records=10**6, batch_size=50, steps_per_round=1, rounds=1).delta == 1e-7
    with pytest.raises(ConfigError, match=r"privacy\.record_dp\.delta.*>= 1 / 100"):
        R.plan(RecordDPConfig(epsilon=4.0, delta=0.01), client_id=0, records=100, batch_size=10,
               steps_per_round=1, rounds=1)


@pytest.mark.parametrize("key,value", [("epsilon", 0), ("epsilon", -1), ("epsilon", ".inf"), ("clip_norm", 0),
                                       ("delta", 1.5), ("noise_multiplier", 0), ("site_epsilon", "{1: -2}")])
def test_config_refuses_bad_record_dp_values_naming_the_key(key, value):
    overrides = ["privacy.record_dp.epsilon=4", f"privacy.record_dp.{key}={value}"]
    with pytest.raises(ConfigError, match=rf"privacy\.record_dp\.{key}"):
        from_mapping({}, overrides)


@pytest.mark.parametrize("task", ["hin", "events"])
def test_graph_tasks_refuse_record_dp_naming_the_task_and_why(task):
    cfg = from_mapping({"task": {"name": task}, "privacy": {"record_dp": {"epsilon": 4}}})
    with pytest.raises(ConfigError, match=rf"task {task!r} cannot take record-level DP: .*neighbours' gradients"):
        resolve(cfg)


def test_accountant_state_continues_and_refuses_another_plan():
    acc = R.SiteAccountant(_plan())
    acc.spend(5)
    twin = R.SiteAccountant(_plan())
    twin.load(acc.state())
    assert twin.steps == 5 and twin.epsilon == acc.epsilon
    with pytest.raises(ValueError, match="record_dp plan"):
        R.SiteAccountant(_plan(noise_multiplier=2.0)).load(acc.state())
    with pytest.raises(ValueError, match="no valid record_dp accountant"):
        twin.load({"steps": -1, "plan": acc.plan.header()})


def _task(tmp_path: Path, settings: RecordDPConfig, rounds: int) -> SyntheticTask:
    spec = R.SiteSettings(settings, rounds, secret_seed=99)
    cfg = SyntheticTask.Config(samples_per_site=100, batch_size=20, hidden=8, embed_dim=4)
    return SyntheticTask(cfg, Site(client_id=0, num_clients=2, seed=0, out_dir=tmp_path, record_dp=spec))


def test_a_site_trains_until_its_budget_then_stops_with_its_model_unchanged(tmp_path):
    # z = 1.5 at q = 0.2, 5 steps a round: rounds 1, 2, 3 cost ε 1.86, 2.42, 2.86 at δ = 1e-4
    task = _task(tmp_path, RecordDPConfig(epsilon=2.6, noise_multiplier=1.5, delta=1e-4), rounds=10)
    first = task.fit(0)
    assert first.num_examples == 100 and first.metrics["record_dp_stopped"] == 0.0
    second = task.fit(1)
    assert second.metrics["record_dp_epsilon"] <= 2.6 and "train_loss" not in second.metrics
    before = task.get_parameters()
    third = task.fit(2)
    assert third.num_examples == 0 and third.metrics["record_dp_stopped"] == 1.0
    assert third.metrics["record_dp_epsilon"] == second.metrics["record_dp_epsilon"]
    after = task.get_parameters()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert task.evaluate(2, final=True)["record_dp_epsilon"] == second.metrics["record_dp_epsilon"]


def test_a_resumed_site_reports_the_same_epsilon_and_refuses_other_settings(tmp_path):
    settings = RecordDPConfig(epsilon=6.0)
    task = _task(tmp_path, settings, rounds=4)
    for rnd in range(2):
        task.fit(rnd)
    state = task.state_dict()
    twin = _task(tmp_path, settings, rounds=4)
    twin.load_state_dict(state)
    assert twin.private.accountant.epsilon == task.private.accountant.epsilon > 0
    assert twin.fit(2).metrics == task.fit(2).metrics
    other = _task(tmp_path, RecordDPConfig(epsilon=2.0), rounds=4)
    with pytest.raises(ValueError, match="record_dp plan"):
        other.load_state_dict(state)


def test_the_record_dp_quickstart_config_takes_full_batch_sgd_and_spends_its_budget_over_the_run(tmp_path):
    """configs/quickstart_record_dp.yaml (the recipe docs/guides/privacy.md recommends): every step samples
    all 500 records (q = 1), 16 steps a round by SGD with momentum, and the run's 8 rounds end within ε 8
    with none of it left unspent beyond the accountant's slack."""
    from hpcfed.config import load
    from hpcfed.schema import build
    from hpcfed.tasks.sgd import SGD

    cfg = load(Path(__file__).resolve().parents[2] / "configs" / "quickstart_record_dp.yaml")
    task_cls = resolve(cfg).task
    spec = R.SiteSettings(cfg.privacy.record_dp, cfg.rounds, secret_seed=7)
    task = task_cls(build(task_cls.Config, cfg.task.options), Site(client_id=0, num_clients=4, seed=cfg.seed,
                                                                    out_dir=tmp_path, record_dp=spec))
    assert isinstance(task.optimizer, SGD) and task.optimizer.param_groups[0]["momentum"] == 0.9
    plan = task.private.plan
    assert (plan.sample_rate, plan.steps_per_round, plan.records, plan.delta) == (1.0, 16, 500, 1e-5)
    for rnd in range(cfg.rounds):
        assert task.fit(rnd).metrics["record_dp_stopped"] == 0.0
    assert 7.99 < task.private.accountant.epsilon <= 8.0 + 1e-9
    assert task.fit(cfg.rounds).num_examples == 0  # a ninth round would pass the target


class _Tiny(TorchTask):
    def build_model(self):
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))

    def train_data(self):
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(60, 4, generator=g), torch.randint(0, 3, (60,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=12, shuffle=True)

    def eval_data(self, split):
        return self.train_data()


class _Streamed(_Tiny):
    def train_data(self):
        return [(torch.randn(12, 4), torch.randint(0, 3, (12,)))]


def _torch_task(cls, tmp_path: Path, **config):
    spec = R.SiteSettings(RecordDPConfig(epsilon=3.0), rounds=2, secret_seed=5)
    return cls(cls.Config(**config), Site(client_id=0, num_clients=2, seed=0, out_dir=tmp_path, record_dp=spec))


def test_torch_task_trains_by_dp_sgd_over_its_dataset_and_resumes_its_accountant(tmp_path):
    task = _torch_task(_Tiny, tmp_path, local_epochs=2)
    assert task.private.plan.steps_per_round == 10 and task.private.plan.sample_rate == 0.2
    before = task.get_parameters()
    result = task.fit(0)
    assert result.num_examples == 60 and 0 < result.metrics["record_dp_epsilon"] < 3.0
    assert any(not np.array_equal(before[k], v) for k, v in task.get_parameters().items())
    twin = _torch_task(_Tiny, tmp_path, local_epochs=2)
    twin.load_state_dict(task.state_dict())
    assert twin.fit(1).metrics == task.fit(1).metrics
    assert task.evaluate(1, final=True)["record_dp_epsilon"] == pytest.approx(3.0, abs=0.01)


class _Normed(_Tiny):
    def build_model(self):
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))


def test_torch_task_refuses_record_dp_where_it_cannot_bound_one_record(tmp_path):
    with pytest.raises(ValueError, match="map-style dataset"):
        _torch_task(_Streamed, tmp_path)
    with pytest.raises(ValueError, match="personalize_epochs"):
        _torch_task(_Tiny, tmp_path, personalize_epochs=1)
    with pytest.raises(ValueError, match=r"BatchNorm \(1\)"):
        _torch_task(_Normed, tmp_path)


def test_hooks_vmap_and_one_pass_per_example_give_the_same_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 0, 1, 1])
    got = {}
    for method in ("hooks", "vmap", "loop"):
        sgd = DPSGD(model, lambda x, y: torch.nn.functional.cross_entropy(model(x), y), _plan())
        sgd.method = method
        got[method] = sgd.per_example_grads(x, y)
        assert sgd.method == method  # each path ran as asked, none fell back
    for method in ("vmap", "loop"):
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got["hooks"], got[method], strict=True))


def test_a_parameter_the_hooks_miss_falls_back_to_vmap_then_to_one_pass_per_example():
    torch.manual_seed(0)
    holder = torch.nn.Module()  # a bare parameter, used outside any layer's forward: no hook sees it
    holder.w = torch.nn.Parameter(torch.randn(2, 3))

    def linear(x, y):
        return torch.nn.functional.cross_entropy(x @ holder.w.T, y)

    def branching(x, y):  # data-dependent control flow, as Hugging Face's attention-mask shortcuts have
        out = x @ holder.w.T if bool((x.abs() < 1e9).all()) else x @ holder.w.T * 0
        return torch.nn.functional.cross_entropy(out, y)

    x, y = torch.randn(5, 3), torch.tensor([0, 1, 0, 1, 1])
    vmapped, looped = DPSGD(holder, linear, _plan()), DPSGD(holder, branching, _plan())
    a, b = vmapped.per_example_grads(x, y), looped.per_example_grads(x, y)
    assert (vmapped.method, looped.method) == ("vmap", "loop") and looped.looped
    assert torch.allclose(a[0], b[0], atol=1e-6)
    one = torch.autograd.grad(linear(x[2:3], y[2:3]), holder.w)[0]
    assert torch.allclose(a[0][2], one, atol=1e-6)


def test_a_lora_adapted_transformer_takes_the_hooks_with_the_gradients_of_one_pass_per_example():
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    lora = peft.LoraConfig(r=2, target_modules=["query", "value"])
    encoder = peft.get_peft_model(transformers.BertModel(config), lora)
    head = torch.nn.Linear(16, 3)
    model = torch.nn.ModuleDict({"encoder": encoder, "head": head}).train()

    def loss(x, y):  # padded documents: the attention mask is the code vmap cannot run
        out = encoder(input_ids=x["input_ids"], attention_mask=x["attention_mask"]).last_hidden_state[:, 0]
        return torch.nn.functional.cross_entropy(head(out), y)

    x = {"input_ids": torch.randint(0, 100, (4, 12)), "attention_mask": torch.ones(4, 12, dtype=torch.long)}
    x["attention_mask"][:2, 8:] = 0
    y = torch.tensor([0, 1, 2, 0])
    hooked, looped = DPSGD(model, loss, _plan()), DPSGD(model, loss, _plan())
    looped.method = "loop"
    got, want = hooked.per_example_grads(x, y), looped.per_example_grads(x, y)
    assert hooked.method == "hooks" and len(got) == len(hooked.names) == 2 * 2 + 2  # 2 adapters x A, B + head
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want, strict=True))
    assert not hasattr(model.head.weight, "grad_sample")  # the hooks are gone after the step
    fast = DPSGD(model, loss, _plan())  # a site's path: the adapters and the head are all linear layers
    assert fast.method == "linear"
    with fast.hooked():
        sums = fast._linear.clipped_sum(lambda: loss(x, y), 4, 1.0)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(sums, hooked.clipped_sum(want), strict=True))


def _both_sums(model, loss, x, y, clip=0.5):
    """The clipped sums by the linear layers' products and by Opacus's per-example gradients."""
    fast = DPSGD(model, loss, _plan(clip_norm=clip))
    assert fast.method == "linear"
    with fast.hooked():
        got = fast._linear.clipped_sum(lambda: loss(x, y), int(y.shape[0]), clip)
    slow = DPSGD(model, loss, _plan(clip_norm=clip))
    slow.method = "hooks"
    want = slow.clipped_sum(slow.per_example_grads(x, y))
    return got, want


def test_linear_layers_clipped_sums_equal_per_example_clipping_with_one_huge_example():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)  # a frozen tensor inside a trained layer is left out, as by the hooks
    x, y = torch.randn(6, 3), torch.tensor([0, 1, 0, 1, 0, 1])
    x[0] *= 1e6

    def loss(x, y):
        return torch.nn.functional.cross_entropy(model(x), y)

    got, want = _both_sums(model, loss, x, y)
    assert len(got) == 3 and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want, strict=True))
    without, _ = _both_sums(model, loss, x[1:], y[1:])
    diff = torch.cat([(a - b).flatten() for a, b in zip(got, without, strict=True)])
    assert float(torch.linalg.vector_norm(diff)) <= 0.5 * (1 + 1e-5)  # example 0 adds at most C


def test_linear_layers_over_sequences_and_their_fallback_to_the_hooks():
    torch.manual_seed(0)
    inner, head = torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)
    model = torch.nn.ModuleDict({"inner": inner, "head": head})

    def pooled(x, y):  # batch x tokens x features, as adapters see a sequence
        return torch.nn.functional.cross_entropy(head(torch.tanh(inner(x)).mean(1)), y)

    x, y = torch.randn(5, 7, 3), torch.tensor([0, 1, 0, 1, 1])
    got, want = _both_sums(model, pooled, x, y)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want, strict=True))

    def twice(x, y):  # one layer called twice in a forward: its rows' gradients add up, which this does not do
        return torch.nn.functional.cross_entropy(head(torch.tanh(inner(x[:, 0])) + torch.tanh(inner(x[:, 1]))), y)

    sgd = DPSGD(model, twice, _plan())
    sgd.set_noisy_grad(x, y, 5, round_generator(1, 0, 0))
    assert sgd.method == "hooks" and inner.weight.grad is not None
    assert not sgd._linear.attached and not hasattr(inner.weight, "grad_sample")
