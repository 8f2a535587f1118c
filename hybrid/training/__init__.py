"""The pretraining driver: arguments, the training loop, checkpoints and text generation."""
