"""AlgorithmSpec's choices (keel.algo.spec): each `Literal` name type lists exactly the keys of
the registry it indexes, and the config offers exactly those choices."""

from typing import get_args, get_type_hints

from keel.algo import (
    ADVANTAGE_ESTIMATORS,
    AGG_MODES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageName,
    AggMode,
    KLEstimatorName,
    PolicyLossName,
)
from keel.algo.kl_control import KLControlOptions
from keel.algo.preference import DPO_LOSSES, DPOLossName
from keel.config import algorithms


def test_the_name_types_list_the_registry_keys_in_order():
    assert get_args(AdvantageName) == tuple(ADVANTAGE_ESTIMATORS)
    assert get_args(PolicyLossName) == tuple(POLICY_LOSSES)
    assert get_args(AggMode) == AGG_MODES
    assert get_args(KLEstimatorName) == KL_ESTIMATORS
    assert get_args(DPOLossName) == DPO_LOSSES


def test_the_config_offers_the_same_choices():
    loss_mode = algorithms.PolicyLossConfig.model_fields["loss_mode"].annotation
    # bypass_mode is chosen by algorithm.rollout_correction.bypass_mode, not by loss_mode
    assert (*get_args(loss_mode), "bypass_mode") == get_args(PolicyLossName)
    preset = algorithms.RolloutCorrectionConfig.model_fields["preset"].annotation
    assert set(get_args(get_args(preset)[0])) == set(algorithms.ROLLOUT_CORRECTION_PRESETS)
    assert len(algorithms.ROLLOUT_CORRECTION_PRESETS) == 19  # verl 0.9.1's
    assert get_args(algorithms.AggMode) == get_args(AggMode)
    assert get_args(algorithms.KLType) == get_args(KLEstimatorName)
    assert get_args(algorithms.DPOLossType) == get_args(DPOLossName)
    kl_ctrl = algorithms.KLControlConfig.model_fields
    assert get_type_hints(KLControlOptions).keys() == kl_ctrl.keys()
    assert get_args(get_type_hints(KLControlOptions)["type"]) == get_args(
        kl_ctrl["type"].annotation
    )
