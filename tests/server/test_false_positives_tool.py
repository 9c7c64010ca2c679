"""tools/false_positives.py moves models in and out of its sites by its own short path
(`site_io`): it must give the values of the task's own `set_parameters` / `get_parameters`, before
and after real local training, for both models the tool measures."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from conftest import REPO

from hpcfed.params import ParamLayout


def _tool():
    spec = importlib.util.spec_from_file_location("false_positives", REPO / "tools" / "false_positives.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("model", ["quickstart", "torch"])
def test_site_io_matches_the_tasks_own_path(model, tmp_path):
    tool = _tool()
    sites = tool.make_sites("feature shift", 2, 0, tmp_path, model)
    layout = ParamLayout.of(sites[0].get_parameters())
    load, read = tool.site_io(sites, layout)
    flat = np.random.default_rng(1).normal(size=layout.size).astype(np.float32)
    load(1, flat)
    assert np.array_equal(layout.flatten(sites[1].get_parameters()), flat)  # into site 1 only
    assert not np.array_equal(layout.flatten(sites[0].get_parameters()), flat)
    sites[1].fit(0)
    trained = read(1)
    assert trained.dtype == np.float32 and not np.array_equal(trained, flat)
    assert np.array_equal(trained, layout.flatten(sites[1].get_parameters()))
    trained[:] = 0.0  # the guard clips what it read in place: the site's model must not move with it
    assert not np.array_equal(layout.flatten(sites[1].get_parameters()), trained)


def test_site_io_falls_back_to_the_tasks_path_without_a_torch_module(tmp_path):
    tool = _tool()
    sites = tool.make_sites("dirichlet 0.5", 2, 0, tmp_path)
    layout = ParamLayout.of(sites[0].get_parameters())
    model = sites[0].model
    del sites[0].model  # no module to reach into: every site goes the task's own way
    load, read = tool.site_io(sites, layout)
    sites[0].model = model
    flat = np.arange(layout.size, dtype=np.float32) / layout.size
    load(0, flat)
    assert np.array_equal(read(0), flat)
    assert np.array_equal(layout.flatten(sites[0].get_parameters()), flat)
