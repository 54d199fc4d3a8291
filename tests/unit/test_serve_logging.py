"""Ray Serve logs at ``logging.level``: both deployments of the application carry it (Serve's
per-request access lines are INFO records), without starting Ray or Serve."""

from __future__ import annotations

import pytest

from configs import load_config
from serving.app import kvfleet_app


@pytest.mark.parametrize("level", ["INFO", "WARNING", "ERROR"])
def test_both_deployments_log_at_the_configured_level(level: str) -> None:
    ingress = kvfleet_app(load_config("tiny", [f"logging.level={level}"]))._bound_deployment
    controller = ingress.init_args[0]._bound_deployment
    for deployment in (ingress, controller):
        assert deployment._deployment_config.logging_config["log_level"] == level
