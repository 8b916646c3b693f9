"""Models built from torch_mp's layers: the GPT that the examples, ``make demo`` and the tests
train (:mod:`torch_mp.models.gpt`), and its trainers (:mod:`torch_mp.models.gpt_training`)."""

from torch_mp.models.gpt import (
    Corpus,
    DenseGPT,
    GPTConfig,
    GPTStage,
    build_stages,
    dense_loss,
    gpt2_init_std,
    sample,
)
from torch_mp.models.gpt_training import (
    DenseTrainer,
    Trainer3D,
    TrainingOptions,
    differences,
    learning_rate,
)

__all__ = [
    "Corpus",
    "DenseGPT",
    "DenseTrainer",
    "GPTConfig",
    "GPTStage",
    "Trainer3D",
    "TrainingOptions",
    "build_stages",
    "dense_loss",
    "differences",
    "gpt2_init_std",
    "learning_rate",
    "sample",
]
