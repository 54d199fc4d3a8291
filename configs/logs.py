"""Process-wide logging set up from the ``logging`` section of a ClusterConfig."""

from __future__ import annotations

import logging

from configs.schema import LoggingConfig


def setup_logging(config: LoggingConfig) -> None:
    """Configure the root logger once per process with the configured level and format."""
    logging.basicConfig(level=config.level, format=config.format, force=True)
