"""Both estimators' outputs equal, to the byte, what they gave on the recorded cases
(``tests/estimator_cases.py``: a seeded sample of the estimate and default spaces over several
models, GPUs, process counts and variable-length data; ``python -m tests.estimator_cases``
records them): a change to the estimator's structure changes no prediction."""

from __future__ import annotations

import json

from tests import estimator_cases


def test_estimator_outputs_equal_the_recorded_ones() -> None:
    data = json.loads(estimator_cases.FIXTURE.read_text())
    got = estimator_cases.outputs(data["cases"])
    differ = [
        (case["method"], case["model"], case["config"], want, have)
        for case, want, have in zip(data["cases"], data["outputs"], got, strict=True)
        if want != have
    ]
    assert not differ, f"{len(differ)} of {len(got)} outputs differ; first: {differ[0]}"
