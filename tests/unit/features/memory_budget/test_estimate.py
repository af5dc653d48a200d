"""The per-rank peak estimate against every peak the small_batch recipe's benchmark records
measured (docs/benchmarks/, named per row in :data:`records.MEASURED`): within
:data:`TOLERANCE_GIB`, also for two runs the coefficients were not fitted to; the coefficients are
the least-squares ones of those records; the static part is exact arithmetic of the parameter
counts."""

import pytest

from megatron.patchset.features.memory_budget import estimate as est
from tests.unit.features.memory_budget import records
from tests.unit.features.memory_budget.records import (
    L1_1X4096,
    L2_1X4096,
    MEMORY_80G,
    MOMENTS,
    NONE,
    REF_4X4096,
    shape,
)

TOLERANCE_GIB = 0.25


def _id(row):
    name, run, levers, gib = row
    return f"{name.removesuffix('.md')}:{levers.describe()}:{gib}"


@pytest.mark.parametrize("row", records.MEASURED + records.HELD_OUT, ids=_id)
def test_the_estimate_meets_the_measured_peak(row):
    name, run, levers, measured = row
    assert f"{measured:.2f}" in records.record_text(name), f"{name} does not hold {measured}"
    got = est.estimate(shape(run), levers).gib
    assert abs(got - measured) <= TOLERANCE_GIB, (name, levers.describe(), got, measured)


def test_the_coefficients_are_the_records_least_squares_fit():
    fitted = est.fit([(shape(run), levers, gib) for _, run, levers, gib in records.MEASURED])
    for name, value, fit in zip(
        ("TOKEN_TENSORS", "DISPATCH_TENSORS", "LOGIT_COPIES", "NATIVE_LOSS_BYTES", "FIXED_GIB"),
        est.COEFFICIENTS,
        fitted,
        strict=True,
    ):
        assert value == pytest.approx(fit, abs=0.05), (name, value, fit)


def test_the_static_memory_is_the_parameter_arithmetic():
    """bf16 parameters, fp32 gradients, fp32 main parameters and moments: 18 bytes a parameter on
    one GPU; bf16 moments save 4 of them. Under the distributed optimizer the state is divided over
    the data-parallel ranks for dense parameters and over the expert data-parallel ranks for the
    experts' (L1: 32 and 4; L2: 8 and 1)."""
    ref = shape(REF_4X4096)
    params = ref.dense_params + ref.expert_params
    full, moments = est.estimate(ref, NONE), est.estimate(ref, MOMENTS)
    assert full.parameters + full.gradients + full.optimizer == 18 * params
    assert full.total - moments.total == 4 * params
    l1, l2 = shape(L1_1X4096), shape(L2_1X4096)
    assert (l1.dense_shards, l1.expert_shards, l2.dense_shards, l2.expert_shards) == (32, 4, 8, 1)
    assert l1.expert_params == l2.expert_params and l1.dense_params == l2.dense_params
    sharded = l1.dense_params / 32 + l1.expert_params / 4
    assert est.estimate(l1, NONE).optimizer == 12 * sharded
    # L1 and L2 differ in the optimizer's shards only: the records' difference is that
    difference = est.estimate(l2, MEMORY_80G).total - est.estimate(l1, MEMORY_80G).total
    assert difference / est.GIB == pytest.approx(89.53 - 68.14, abs=0.1)


def test_each_lever_saves_what_it_keeps():
    l1 = shape(L1_1X4096)
    rows = l1.tokens * l1.expert_rows_per_token * l1.moe_layers  # the static dispatch's slots
    act = est.estimate(l1, est.Levers(recompute=("moe_act",)))
    norm = est.estimate(l1, est.Levers(recompute=("moe_act", "layernorm")))
    none = est.estimate(l1, NONE)
    assert none.activations - act.activations == pytest.approx(rows * 2 * l1.moe_ffn)
    assert act.activations - norm.activations == pytest.approx(
        l1.tokens * l1.layers * 2 * l1.hidden
    )
