"""The op sets the model's forward is written over: ``layer_ops`` (the ``LayerOps`` protocol, the PyTorch ops,
the choice at engine build) and ``cuda_ops`` (the fused Triton kernels). ``model.py`` imports the ops; the
ops never import the model: what they read of its modules is typed structurally in ``protocols``."""
