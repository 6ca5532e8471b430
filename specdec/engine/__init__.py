"""The engine's model runner and workers: ``ModelRunner`` (static shapes, CUDA graphs, compile),
``TargetWorker`` (verify: forward + rejection sampler) and ``DraftWorker`` (catch up + draft).
"""
