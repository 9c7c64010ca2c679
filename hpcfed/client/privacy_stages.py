"""The stages that turn a trained model into a site's secure aggregation input
(`hpcfed.privacy.site_input` holds the encoding's spec and math): the update delta, its clip to
L2 norm C, distributed DP's noise (only when ``privacy.dp`` is set) and the fixed-point encoding
with the site's weight. `hpcfed.client.secagg.SecAggSite` masks and sends what they make.

    Delta: δ = trained − sent (float64)        Clip: factor = min(1, C / ‖δ‖₂)
    Noise: δ ← factor·δ + N(0, (z·C/√m)²)      Encode: w·factor·δ in fixed point, then n (w = n / max_examples)

With discrete (Skellam) noise there is no Noise stage: Encode rounds factor·δ to the grid at random
and adds integer noise there (`site_input.encode_discrete`).

The clip's factor is not applied by `Clip`: `Encode` folds it into the fixed-point pass (one
float64 temporary, as `site_input.encode_update`), and `Noise` applies it before adding noise.
"""

from __future__ import annotations

from hpcfed.client.upload import RoundStart, Stage, Upload, Upstream
from hpcfed.errors import FederationError
from hpcfed.params import ParamLayout
from hpcfed.privacy import masking
from hpcfed.privacy.dp import clip_factor
from hpcfed.privacy.site_input import InputSpec, encode_discrete, noised


class Delta(Stage):
    """The update delta: the trained model minus the model as loaded, as float64 vectors by `layout`."""

    def __init__(self, layout: ParamLayout) -> None:
        self.layout = layout

    def __call__(self, start: RoundStart, upstream: Upstream) -> Upload:
        sent = self.layout.flatten(start.current_model())  # before training: the model as received
        upload = upstream(start)
        upload.sent = sent
        upload.delta = self.layout.difference(upload.params, sent)  # one pass, no float32 copy first
        return upload


class Clip(Stage):
    """Bounds the delta's L2 norm by `clip_norm` (C): records the factor min(1, C/‖δ‖) and whether it
    was within (a non-finite norm is refused: ValueError)."""

    def __init__(self, clip_norm: float) -> None:
        self.clip_norm = clip_norm

    def __call__(self, start: RoundStart, upstream: Upstream) -> Upload:
        upload = upstream(start)
        assert upload.delta is not None, "Clip runs downstream of Delta"
        upload.scale, upload.within = clip_factor(upload.delta, self.clip_norm)
        return upload


class Noise(Stage):
    """Distributed DP: the clipped delta plus this site's share of the Gaussian noise, std z·C/√m."""

    def __init__(self, noise_std: float) -> None:
        self.noise_std = noise_std

    def __call__(self, start: RoundStart, upstream: Upstream) -> Upload:
        upload = upstream(start)
        assert upload.delta is not None, "Noise runs downstream of Delta"
        upload.delta, upload.scale = noised(upload.delta, upload.scale, self.noise_std), 1.0
        return upload


class Encode(Stage):
    """The fixed-point input: w·factor·δ with w = n / max_examples, then n (1 for every site when
    weighting is uniform or under DP); a count beyond ``privacy.secagg.max_examples`` is refused."""

    def __init__(self, spec: InputSpec, uniform: bool, client_id: int) -> None:
        self.spec, self.client_id = spec, client_id
        self.uniform = uniform or spec.noise_std > 0

    def __call__(self, start: RoundStart, upstream: Upstream) -> Upload:
        upload = upstream(start)
        assert upload.delta is not None, "Encode runs downstream of Delta"
        weight = self.weight(upload)
        if not 0 <= weight <= self.spec.max_examples:
            raise FederationError(f"client {self.client_id}: {upload.num_examples} training examples, outside 0.."
                                  f"privacy.secagg.max_examples={self.spec.max_examples}; raise it on every rank")
        if self.spec.discrete:  # distributed DP's integer noise, added on the grid
            upload.codes = encode_discrete(upload.delta, upload.scale, self.spec)
            return upload
        upload.codes = masking.encode(upload.delta, weight, self.spec.max_examples, self.spec.value_range,
                                      self.spec.levels, upload.scale)
        return upload

    def weight(self, upload: Upload) -> int:
        """The count this site's input is weighted by: its examples, or 1 when sites weigh alike."""
        return 1 if self.uniform else upload.num_examples
