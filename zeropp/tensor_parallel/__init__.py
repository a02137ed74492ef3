"""Tensor parallelism (Megatron-LM's layout) with AccTFM's pipelined and compressed all-reduces,
applied to a models.transformer.Transformer from outside; docs/tensor_parallel.md.

  parallelize.py  the model slicing: which module becomes which parallel layer (no communication)
  layers.py       the parallel layers (column / row / vocabulary-parallel) and the sublayer wrapper
                  that runs f and g per batch partition, with token top-k and quantization
  collectives.py  the group's all-reduces (TPComm) and Megatron's f and g as autograd functions
  loss.py         cross-entropy from vocabulary-sliced logits
  runtime.py      TensorParallelRuntime (the Runtime around DDP or ZeRO-3, partition planning) and
                  its checkpoints (save, load at any TP size, offline consolidation)

The AccTFM algorithms themselves (quantization, top-k scores, the partition planner) are plain
functions in zeropp/acctfm.py.
"""
