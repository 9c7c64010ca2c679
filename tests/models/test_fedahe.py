"""FedAHE attention math against the spec's hand values (algorithms.md section 2, tests 1-4)."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import scipy.sparse as sp  # noqa: E402

from hpcfed.data.hin import metapath_adjacency, row_normalize, synthetic_hin  # noqa: E402
from hpcfed.data.partition import assign_owners, site_view  # noqa: E402
from hpcfed.models.fedahe import FedAHE, MetapathInput, metapath_attention, node_attention  # noqa: E402


def test_node_attention_hand_values() -> None:
    # W_s = I2; projections of nodes 0, 1, 2 = (1,0), (1,0), (0,1); N_0 = {0, 1, 2}
    h = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    c, e_n = node_attention(h[:1], h, torch.zeros(3, dtype=torch.long), 1)
    e = math.e
    assert c.numpy() == pytest.approx([e / (2 * e + 1), e / (2 * e + 1), 1 / (2 * e + 1)], abs=1e-6)
    assert c.numpy() == pytest.approx([0.422319, 0.422319, 0.155362], abs=1e-6)
    assert e_n[0].numpy() == pytest.approx([0.699441, 0.538763], abs=1e-6)


def test_isolated_node_attends_to_itself() -> None:
    h = torch.tensor([[0.3, -0.2]])
    c, e_n = node_attention(h, h, torch.zeros(1, dtype=torch.long), 1)
    assert float(c[0]) == pytest.approx(1.0)
    assert e_n[0].numpy() == pytest.approx(torch.sigmoid(h[0]).numpy())


def test_zero_projection_gives_zero_cosine() -> None:
    h_self = torch.zeros(1, 2)
    h_nbr = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    c, _ = node_attention(h_self, h_nbr, torch.zeros(2, dtype=torch.long), 1)
    assert c.numpy() == pytest.approx([0.5, 0.5])  # both cosines are 0 via eps, not NaN


def _identity_wp() -> torch.nn.Linear:
    wp = torch.nn.Linear(2, 2)
    with torch.no_grad():
        wp.weight.copy_(torch.eye(2))
        wp.bias.zero_()
    return wp


def test_metapath_attention_hand_values() -> None:
    e_paths = torch.tensor([[[2.0, 0.0], [0.0, 3.0]]])  # e^{π1} = (2,0), e^{π2} = (0,3)
    p = torch.tensor([[1.0, 0.0]])
    delta, e = metapath_attention(e_paths, p, _identity_wp())
    assert delta[0].detach().numpy() == pytest.approx([0.731059, 0.268941], abs=1e-6)
    assert e[0].detach().numpy() == pytest.approx([1.462117, 0.806824], abs=1e-6)


def test_metapath_permutation_invariance_and_edge_cases() -> None:
    gen = torch.Generator().manual_seed(0)
    e_paths = torch.randn(5, 3, 4, generator=gen)
    p = torch.rand(5, 2, generator=gen)
    wp = torch.nn.Linear(4, 2)
    delta, e = metapath_attention(e_paths, p, wp)
    perm = [2, 0, 1]
    delta_p, e_p = metapath_attention(e_paths[:, perm], p, wp)
    assert torch.allclose(delta_p, delta[:, perm], atol=1e-6)
    assert torch.allclose(e_p, e, atol=1e-6)
    # M = 1 -> δ = 1; all δ' equal -> δ = 1/M
    d1, e1 = metapath_attention(e_paths[:, :1], p, wp)
    assert torch.allclose(d1, torch.ones(5, 1)) and torch.allclose(e1, e_paths[:, 0])
    same = e_paths[:, :1].expand(5, 3, 4)
    d3, _ = metapath_attention(same, p, wp)
    assert torch.allclose(d3, torch.full((5, 3), 1 / 3), atol=1e-6)


def _site_model(client_id: int) -> tuple[FedAHE, list[MetapathInput]]:
    hin = synthetic_hin(papers_per_class=20, authors_per_class=10, train_per_class=4, val_per_class=4, seed=1)
    owners = assign_owners(hin, 3, "random", seed=0)
    view = site_view(hin, owners, client_id)
    inputs = [MetapathInput(metapath_adjacency(view, mp)) for mp in hin.metapaths]
    torch.manual_seed(0)
    model = FedAHE(num_nodes=hin.num_targets, input_dim=inputs[0].input_dim, num_metapaths=2, num_classes=3,
                   dim=8, pref_dim=4)
    return model, inputs


def test_parameter_shapes_do_not_depend_on_the_sites_edges() -> None:
    (m0, in0), (m1, in1) = _site_model(0), _site_model(1)
    assert sum(len(i.indices) for i in in0) != sum(len(i.indices) for i in in1)
    shapes0 = {k: tuple(v.shape) for k, v in m0.state_dict().items()}
    shapes1 = {k: tuple(v.shape) for k, v in m1.state_dict().items()}
    assert shapes0 == shapes1
    assert shapes0["ws.0.weight"] == (8, 60) and shapes0["p"] == (60, 4)
    logits = m0(in0, np.arange(10), 100, np.random.default_rng(0))
    assert logits.shape == (10, 3) and torch.isfinite(logits).all()


def test_model_is_invariant_to_the_order_of_meta_paths() -> None:
    model, inputs = _site_model(0)
    nodes = np.arange(12)
    e, delta = model.embed(inputs, nodes, None, np.random.default_rng(0), return_attention=True)
    swapped = FedAHE(num_nodes=60, input_dim=60, num_metapaths=2, num_classes=3, dim=8, pref_dim=4)
    state = model.state_dict()
    for name in ("ws", "wc"):  # move meta-path 0's weights to slot 1 and back
        for suffix in ("weight", "bias"):
            a, b = f"{name}.0.{suffix}", f"{name}.1.{suffix}"
            state[a], state[b] = state[b], state[a]
    swapped.load_state_dict(state)
    e2, delta2 = swapped.embed(inputs[::-1], nodes, None, np.random.default_rng(0), return_attention=True)
    assert torch.allclose(delta2, delta.flip(1), atol=1e-6)
    assert torch.allclose(e2, e, atol=1e-5)


def test_sparse_projection_paths_agree() -> None:
    model, inputs = _site_model(0)
    inp = inputs[1]
    dense = torch.as_tensor(inp.rows.toarray()) @ model.ws[1].weight.t() + model.ws[1].bias
    few = np.array([3, 7])
    assert torch.allclose(inp.project(model.ws[1], few), dense[few], atol=1e-6)  # row-gather path
    everything = np.arange(60)
    assert torch.allclose(inp.project(model.ws[1], everything), dense, atol=1e-6)  # whole-matrix path


def test_feature_input_equals_the_concatenated_row() -> None:
    adj = sp.csr_matrix(np.array([[1, 1, 0], [1, 1, 0], [0, 0, 1]], dtype=np.float32))
    feats = sp.csr_matrix(np.array([[3.0, 4.0], [0.0, 1.0], [1.0, 0.0]], dtype=np.float32))
    inp = MetapathInput(adj, [feats])
    assert inp.input_dim == 5 and inp.unique_rows.shape[0] == 2  # rows 0 and 1 share an adjacency row
    lin = torch.nn.Linear(5, 3)
    concat = np.hstack([row_normalize(adj).toarray(), row_normalize(feats).toarray()])
    expected = torch.as_tensor(concat, dtype=torch.float32) @ lin.weight.t() + lin.bias
    assert torch.allclose(inp.project(lin, np.array([0, 1, 2])), expected, atol=1e-6)


def test_segment_softmax_matches_per_segment_softmax() -> None:
    from hpcfed.models.fedahe import segment_softmax

    s = torch.tensor([1.0, 2.0, 3.0, 50.0, 51.0])
    seg = torch.tensor([0, 0, 0, 1, 1])
    out = segment_softmax(s, seg, 2)
    assert torch.allclose(out[:3], torch.softmax(s[:3], 0)) and torch.allclose(out[3:], torch.softmax(s[3:], 0))
