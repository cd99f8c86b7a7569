"""A LightningCLI app for the CLI tests: ``python tests/cli_app.py fit --trainer.strategy pipeline ...``."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import models
from lightning.pytorch.cli import LightningCLI

import lightning_pipe  # noqa: F401  (registers the "pipeline" strategy names)

if __name__ == "__main__":
    LightningCLI(models.TinyLM, models.TokenData, save_config_kwargs={"overwrite": True})
