"""lms-launch: a distributed training launcher for TensorFlow 2 and Horovod with Large Model Support."""

__version__ = "0.1.0"  # the one place for it: pyproject.toml reads it, `lms-launch --version` prints it
