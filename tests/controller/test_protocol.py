"""keel.controller.protocol: every stage's controller is a Controller; which of them skip data on
a guard rollback (rl and sft skip the batches since the checkpoint; rm and dpo never did)."""

from keel.controller.preference import DPOController, RewardModelController
from keel.controller.protocol import Controller
from keel.controller.rl import RLController
from keel.controller.runner import CONTROLLERS
from keel.controller.sft import SFTController


def test_every_stage_has_a_controller_of_the_protocol():
    assert set(CONTROLLERS) == {"rl", "sft", "rm", "dpo"}
    assert all(Controller in cls.__mro__ for cls in CONTROLLERS.values())  # type: ignore[union-attr]


def test_only_rl_and_sft_skip_batches():
    assert RLController.skips_batches and SFTController.skips_batches
    assert not RewardModelController.skips_batches and not DPOController.skips_batches
    # the levers a pair stage lacks are the Protocol's no-ops, not probed for
    assert DPOController.set_kl_scale is Controller.set_kl_scale
    assert RewardModelController.pop_warnings is Controller.pop_warnings
