"""The vLLM engine backend of the MineDraft engine services (``--engine vllm``).

- ``engine``: ``VllmEngineConfig`` and the in-process ``LLMEngine`` with ``PsdScheduler``;
- ``scheduler``: ``PsdScheduler``, vLLM's scheduler restricted to the batch of each step;
- ``proposer``: ``ExternalDraftProposer``, the ``custom_class`` proposer (drafts come from us);
- ``target``: ``VllmTargetWorker`` (verifier); ``draft``: ``VllmDraftWorker`` (drafter);
- ``outputs``: vLLM outputs -> ``StepOutput`` / ``EngineFacts``.

Importing this package does not import vLLM; building an engine does (``build_engine``).
"""
