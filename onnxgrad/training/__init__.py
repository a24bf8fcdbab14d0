"""Training on onnxruntime: loss helpers, optimizers as ONNX subgraphs, train-step graphs and the
:class:`Trainer` that runs them with the parameters kept on the device."""
from .losses import (LOSSES, attach_loss, bce_with_logits_loss, cross_entropy_loss, l1_loss,
                     mse_loss)
from .optimizers import SGD, Adam, AdamW, Optimizer, clip_grad_norm, make_optimizer
from .step import (TrainStep, build_accumulate_model, build_apply_model, build_gradient_model,
                   build_train_step, export_train_step)
from .trainer import NonFiniteLossError, Trainer

__all__ = ["LOSSES", "attach_loss", "mse_loss", "l1_loss", "cross_entropy_loss",
           "bce_with_logits_loss", "SGD", "Adam", "AdamW", "Optimizer", "make_optimizer",
           "clip_grad_norm", "TrainStep", "build_train_step", "build_gradient_model",
           "build_accumulate_model", "build_apply_model", "export_train_step", "Trainer",
           "NonFiniteLossError"]
