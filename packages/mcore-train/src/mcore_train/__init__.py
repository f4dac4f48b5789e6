"""mcore-train: configs, recipes, the pretraining entry point and training loop.

>>> from mcore_train import load_config, pretrain
>>> config = load_config(recipe="tiny", overrides=["data.mock=true", "training.train_iters=5"])  # doctest: +SKIP
>>> pretrain(config)  # doctest: +SKIP
"""

from mcore_train.api import pretrain
from mcore_train.config import TrainConfig, load_config
from mcore_train.errors import ConfigError, MCoreTrainError, TrainingDiverged
from mcore_train.loop import TrainResult
from mcore_train.recipes import RECIPES

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "pretrain",
    "load_config",
    "TrainConfig",
    "TrainResult",
    "RECIPES",
    "ConfigError",
    "MCoreTrainError",
    "TrainingDiverged",
]
