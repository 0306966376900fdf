"""Tensor and expert parallelism: process groups and collectives over torch.distributed (Gloo on
CPU, NCCL on CUDA), and the parallel layout (which slice of each weight a rank holds). The sharded
layers themselves live with the models (workers/models/parallel_layers.py)."""
