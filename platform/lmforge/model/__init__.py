"""Single-device model code: the GPT, its initialisation and its FLOPs formula. No distributed imports."""

from lmforge.model.gpt import GPT, GPTStage, OutputHead, cross_entropy_loss, num_parameters, param_count_from_config

__all__ = ["GPT", "GPTStage", "OutputHead", "cross_entropy_loss", "num_parameters", "param_count_from_config"]
