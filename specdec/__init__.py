"""The serving engine (torch): what drafter_svc and verifier_svc run.

- ``specdec.engine_api``: the engine seam (``TargetEngine``, ``DraftEngine``, ``EngineFacts``).
- ``specdec.engine``: model runner and workers; ``specdec.kv``: slot KV cache and attention;
  ``specdec.sample``: sampling and the rejection sampler; ``specdec.models``: model dirs, loading,
  the draft format; ``specdec.dataplane``: the draft-probs data planes;
  ``specdec.vllm_backend``: the vLLM engines behind the same seam.

It imports nothing from the control plane (coordinator, gateway), the services or ``minedraft``.
"""
