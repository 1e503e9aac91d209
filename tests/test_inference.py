"""RunInference with JacobianModelHandler: RunInference's batching and model sharing, our engine."""

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.ml.inference.base import RunInference
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.testing.util import assert_that

from jacobeam.transforms.inference import JacobianModelHandler
from jacobeam.transforms.spec import EngineOptions, ModelSource, OutputSelection, Reduction
from tests import models as test_models
from tests.reference import assert_close, tape_loop


def test_run_inference_yields_each_samples_jacobian():
    samples = np.random.default_rng(2).normal(size=(10, 8, 8, 1)).astype(np.float32)
    expected = tape_loop(test_models.small_cnn(), samples)
    handler = JacobianModelHandler(
        ModelSource(factory="tests.models:small_cnn"), (8, 8, 1), EngineOptions(batch_size=4), min_batch_size=3
    )

    def check(results):
        assert len(results) == 10
        by_first_value = {float(r.example.ravel()[0]): r for r in results}
        for sample, jacobian in zip(samples, expected):
            result = by_first_value[float(sample.ravel()[0])]
            assert result.inference["jacobian"].shape == (3, 8, 8, 1)
            assert_close(result.inference["jacobian"], jacobian, rtol=1e-5)
            assert len(result.model_id) == 16

    with beam.Pipeline(runner=FnApiRunner()) as pipeline:
        results = pipeline | beam.Create(list(samples)) | RunInference(handler)
        assert_that(results, check)


def test_reductions_work_through_run_inference():
    samples = np.random.default_rng(3).normal(size=(6, 8)).astype(np.float32)
    full = tape_loop(test_models.coupling_flow(), samples).astype(np.float64)
    handler = JacobianModelHandler(
        ModelSource(factory="tests.models:coupling_flow"), (8,), EngineOptions(batch_size=4, reduce=Reduction("slogdet"))
    )

    def check(results):
        found = {float(r.example[0]): r.inference for r in results}
        for sample, jacobian in zip(samples, full):
            np.testing.assert_allclose(found[float(sample[0])]["logabsdet"], np.linalg.slogdet(jacobian)[1], atol=1e-5)

    with beam.Pipeline(runner=FnApiRunner()) as pipeline:
        assert_that(pipeline | beam.Create(list(samples)) | RunInference(handler), check)


def test_a_two_input_model_through_run_inference():
    import tensorflow as tf

    rng = np.random.default_rng(5)
    examples = [{"image": rng.normal(size=(4, 4, 1)).astype(np.float32), "meta": rng.normal(size=3).astype(np.float32)}
                for _ in range(5)]
    model = test_models.two_inputs()
    handler = JacobianModelHandler(
        ModelSource(factory="tests.models:two_inputs"), {"image": (4, 4, 1), "meta": (3,)}, EngineOptions(batch_size=2)
    )

    def expected(example, name):
        sample = {k: tf.constant(v[None]) for k, v in example.items()}
        with tf.GradientTape() as tape:
            tape.watch(sample[name])
            y = model([sample["image"], sample["meta"]])[0]
        return tape.jacobian(y, sample[name]).numpy().reshape(5, *example[name].shape)

    def check(results):
        assert len(results) == 5
        for result in results:
            for name in ("image", "meta"):
                assert_close(result.inference[f"jacobian/{name}"], expected(result.example, name), rtol=1e-5)

    with beam.Pipeline(runner=FnApiRunner()) as pipeline:
        assert_that(pipeline | beam.Create(examples) | RunInference(handler), check)


def test_labels_travel_with_their_samples_through_run_inference():
    samples = np.random.default_rng(7).normal(size=(9, 12)).astype(np.float32)
    labels = [i % 5 for i in range(9)]
    full = tape_loop(test_models.small_mlp(), samples)  # (9, 5, 12)
    # At most 3 samples a batch: several batches, each with other labels.
    handler = JacobianModelHandler(
        ModelSource(factory="tests.models:small_mlp"), (12,),
        EngineOptions(batch_size=3, outputs=OutputSelection("label")), min_batch_size=2,
    )

    def check(results):
        assert len(results) == 9
        found = {float(r.example[0][0]): r for r in results}
        for sample, label, jacobian in zip(samples, labels, full):
            result = found[float(sample[0])]
            assert result.example[1] == label
            np.testing.assert_array_equal(result.inference["output_index"], [label])
            assert_close(result.inference["jacobian"], jacobian[label][None], rtol=1e-5)

    with beam.Pipeline(runner=FnApiRunner()) as pipeline:
        examples = pipeline | beam.Create(list(zip(samples, labels)))
        assert_that(examples | RunInference(handler), check)


def test_inference_args_are_refused_as_they_are_one_value_for_every_batch():
    handler = JacobianModelHandler(ModelSource(factory="tests.models:small_mlp"), (12,),
                                   EngineOptions(outputs=OutputSelection("label")))
    with pytest.raises(ValueError, match=r"takes no inference_args \(got \['labels'\]\): they are the same for every batch"):
        with beam.Pipeline(runner=FnApiRunner()) as pipeline:
            _ = pipeline | beam.Create([np.zeros(12, np.float32)]) | RunInference(handler, inference_args={"labels": [0]})
