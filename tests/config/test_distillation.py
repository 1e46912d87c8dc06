"""The distillation section: a teacher is required, k1 with the supervised mode is refused, the
top-k forward KL with the policy gradient is warned about (docs/config.md)."""

import pytest

from keel.config.loading import ConfigError


def test_the_distillation_section_is_checked(tiny_grpo):
    with pytest.raises(ConfigError, match=r"distillation\.teacher"):
        tiny_grpo("distillation.enabled=true")
    with pytest.raises(ConfigError, match="use_policy_gradient"):
        tiny_grpo(
            "distillation.enabled=true", "distillation.teacher=x", "distillation.loss_mode=k1"
        )
    with pytest.warns(UserWarning, match="forward_kl_topk"):
        tiny_grpo("distillation.enabled=true", "distillation.teacher=x",
                  "distillation.loss_mode=forward_kl_topk",
                  "distillation.use_policy_gradient=true")  # fmt: skip
