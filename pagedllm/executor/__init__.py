"""Executors between the engine and the model runner: tensor parallelism's driver and workers."""
