"""The quickstart's task with its MLP in NumPy: a federation whose sites never import torch.

The same data as `hpcfed.tasks.synthetic` (same world, same label skew, same splits) and the same
network shape (``dim -> hidden -> embed_dim -> num_classes``, ReLU between, torch's ``nn.Linear``
initialisation), trained by Adam with torch's defaults on mini-batches of the same size; its
gradient is the network's backward pass written out (tests/tasks/test_synthetic_numpy.py checks it
and the optimizer against torch's). What it is for:

- **checking a cluster in seconds**: MPI between nodes, the job key or identity keys, Slurm's
  launch, node-local checkpoint folders, with nothing to install on the compute nodes but NumPy,
  h5py, mpi4py and cryptography (torch's import alone costs a rank ~3 s of CPU);
- **the test suite's federations** that test the server, the channel and the launcher rather than
  a model: each site rank starts in a fraction of the CPU (CONTRIBUTING.md, "The suite's cost").

It uploads, checkpoints, resumes and exports like the quickstart: the parameters travel under the
names torch's `state_dict` would give them, Adam's moments go into the site's shard, and every draw
in `fit(round)` comes from (seed, site, round), so a resumed run repeats the uninterrupted one bit
for bit. It has no per-example gradients (`privacy.record_dp` is refused) and one rank per site.

    hpcfed run configs/quickstart.yaml --np 3 task.name=synthetic_numpy
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcfed.params import Params
from hpcfed.store.embeddings import export_path, write_export
from hpcfed.tasks.base import Bundle, FitResult, Site, Task
from hpcfed.tasks.synthetic import EVALUATION_NOTE, BlobsConfig, macro_f1, make_site_data

_BETAS, _EPS = (0.9, 0.999), 1e-8  # torch.optim.Adam's defaults


class SyntheticNumpyTask(Task):
    """The quickstart's MLP on its label-skewed blobs, in NumPy: no torch on the site."""

    name = "synthetic_numpy"
    uses_torch = False
    record_dp_refusal = "its NumPy network computes one gradient per batch, not one per example"
    evaluation_note = EVALUATION_NOTE

    @dataclass(kw_only=True)
    class Config(BlobsConfig):
        pass  # the quickstart's options but its optimizer, momentum and dtype (Adam, float32 here)

    def __init__(self, config: Config, site: Site) -> None:
        super().__init__(config, site)
        c = config
        self.data = make_site_data(site.seed, site.client_id, num_classes=c.num_classes, dim=c.dim,
                                   modes_per_class=c.modes_per_class, samples=c.samples_per_site,
                                   label_skew=c.label_skew, noise=c.noise)
        # The quickstart's layer names: encoder 0.0 / 0.2, head 2 (nn.Sequential(encoder, ReLU, head)).
        self.params = initial_mlp(site.seed, [("0.0", c.dim, c.hidden), ("0.2", c.hidden, c.embed_dim),
                                              ("2", c.embed_dim, c.num_classes)])
        self.adam = AdamState.zeros_like(self.params)  # the layers' moments: the ballast is never trained
        if c.ballast:
            self.params["ballast"] = np.zeros(c.ballast, np.float32)

    # -- parameters ---------------------------------------------------------------------------
    def get_parameters(self) -> Params:
        return {k: v.copy() for k, v in self.params.items()}

    def set_parameters(self, params: Params) -> None:
        for key, value in self.params.items():
            incoming = np.asarray(params[key], dtype=np.float32)
            if incoming.shape != value.shape:
                raise ValueError(f"parameter {key}: shape {incoming.shape}, the model's is {value.shape}")
            value[...] = incoming

    # -- learning -----------------------------------------------------------------------------
    def fit(self, round: int) -> FitResult:
        c = self.config
        x, y = self.data["x_train"], self.data["y_train"]
        order_rng = np.random.default_rng(np.random.SeedSequence([self.site.seed, self.site.client_id, round]))
        total = 0.0
        for _ in range(c.local_epochs):
            order = order_rng.permutation(len(x))
            for start in range(0, len(x), c.batch_size):
                idx = order[start : start + c.batch_size]
                loss, grads = loss_and_gradients(self.params, x[idx], y[idx])
                self.adam.step(self.params, grads, c.lr)
                total += loss * len(idx)
        count = c.local_epochs * len(x)
        return FitResult(num_examples=len(x), metrics={"train_loss": total / max(count, 1)})

    def evaluate(self, round: int, final: bool = False) -> dict[str, float]:
        split = "test" if final else "val"
        x, y = self.data[f"x_{split}"], self.data[f"y_{split}"]
        logits = forward(self.params, x)[-1]
        loss = float(cross_entropy(logits, y))
        pred = logits.argmax(1)
        acc = float((pred == y).mean())
        if not final:
            return {"val_loss": loss, "val_accuracy": acc}
        return {"loss": loss, "accuracy": acc, "macro_f1": macro_f1(y, pred, self.config.num_classes)}

    def export_embeddings(self, out_dir: Path) -> Path:
        vectors = forward(self.params, self.data["x_test"])[-2]  # the encoder's output, before its ReLU
        ids = [f"site{self.site.client_id}-test{i}" for i in range(len(vectors))]
        return write_export(export_path(out_dir, self.site.client_id), vectors, ids, self.data["y_test"],
                            entity="node", model="synthetic-numpy-mlp", site=self.site.client_id,
                            config_hash=self.site.config_hash, version=0)

    # -- resumable state ------------------------------------------------------------------------
    def state_dict(self) -> Bundle:
        return {"adam_step": self.adam.step_count}, {**{f"exp_avg/{k}": v for k, v in self.adam.exp_avg.items()},
                                                     **{f"exp_avg_sq/{k}": v for k, v in self.adam.exp_avg_sq.items()}}

    def load_state_dict(self, state: Bundle) -> None:
        header, arrays = state
        step = header.get("adam_step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"site state: adam_step must be a count >= 0, got {step!r}")
        for name, moments in (("exp_avg", self.adam.exp_avg), ("exp_avg_sq", self.adam.exp_avg_sq)):
            for key, value in moments.items():
                saved = arrays.get(f"{name}/{key}")
                if saved is None or np.shape(saved) != value.shape:
                    raise ValueError(f"site state: {name}/{key} is missing or not of shape {value.shape}")
                value[...] = saved
        self.adam.step_count = step


# ----------------------------------------------------------------------------------------------
# the network: Linear, ReLU, Linear, ReLU, Linear


def initial_mlp(seed: int, layers: list[tuple[str, int, int]]) -> Params:
    """Each layer's weight (out, in) and bias drawn as torch's ``nn.Linear`` draws them (uniform in
    +-1/sqrt(in)), from `seed` alone, so every site starts from the same model."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 2718]))
    params: Params = {}
    for name, fan_in, fan_out in layers:
        bound = 1.0 / np.sqrt(fan_in)
        params[f"{name}.weight"] = rng.uniform(-bound, bound, size=(fan_out, fan_in)).astype(np.float32)
        params[f"{name}.bias"] = rng.uniform(-bound, bound, size=fan_out).astype(np.float32)
    return params


def _layers(params: Params) -> list[tuple[np.ndarray, np.ndarray]]:
    weights = [k for k in params if k.endswith(".weight")]
    return [(params[w], params[w[: -len("weight")] + "bias"]) for w in weights]  # (the ballast is none)


def forward(params: Params, x: np.ndarray) -> list[np.ndarray]:
    """Every layer's output before its ReLU (the last one is the logits)."""
    outputs, h, layers = [], x, _layers(params)
    for i, (weight, bias) in enumerate(layers):
        z = h @ weight.T + bias
        outputs.append(z)
        h = np.maximum(z, 0.0) if i < len(layers) - 1 else z
    return outputs


def cross_entropy(logits: np.ndarray, y: np.ndarray) -> float:
    """The mean negative log-likelihood of labels `y` under softmax(`logits`)."""
    shifted = logits - logits.max(1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
    return float(-log_probs[np.arange(len(y)), y].mean())


def loss_and_gradients(params: Params, x: np.ndarray, y: np.ndarray) -> tuple[float, Params]:
    """The batch's mean cross-entropy and its gradient for every parameter (backpropagation)."""
    outputs = forward(params, x)
    logits = outputs[-1]
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    delta = probs
    delta[np.arange(len(y)), y] -= 1.0
    delta /= len(y)  # d(mean loss)/d(logits)
    layers = _layers(params)
    names = [k[: -len(".weight")] for k in params if k.endswith(".weight")]
    grads: Params = {}
    for i in range(len(layers) - 1, -1, -1):
        below = x if i == 0 else np.maximum(outputs[i - 1], 0.0)
        grads[f"{names[i]}.weight"] = (delta.T @ below).astype(np.float32)
        grads[f"{names[i]}.bias"] = delta.sum(0).astype(np.float32)
        if i:
            delta = (delta @ layers[i][0]) * (outputs[i - 1] > 0)
    return cross_entropy(logits, y), grads


@dataclass
class AdamState:
    """Adam's moments and step count (torch.optim.Adam's update and defaults, without weight decay)."""

    exp_avg: Params
    exp_avg_sq: Params
    step_count: int = 0

    @classmethod
    def zeros_like(cls, params: Params) -> AdamState:
        return cls({k: np.zeros_like(v) for k, v in params.items()}, {k: np.zeros_like(v) for k, v in params.items()})

    def step(self, params: Params, grads: Params, lr: float) -> None:
        """One update of every parameter in place, in torch's order of operations."""
        self.step_count += 1
        (beta1, beta2), t = _BETAS, self.step_count
        step_size = lr / (1 - beta1**t)
        root_correction = np.sqrt(1 - beta2**t)
        for key, grad in grads.items():
            m, v = self.exp_avg[key], self.exp_avg_sq[key]
            m *= beta1
            m += (1 - beta1) * grad
            v *= beta2
            v += (1 - beta2) * grad * grad
            denom = np.sqrt(v) / root_correction + _EPS
            params[key] -= (step_size * m / denom).astype(np.float32)
