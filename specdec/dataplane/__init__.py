"""The draft-probability data planes between drafter_svc and verifier_svc rank 0: ``dist``
(torch.distributed: gloo control + NCCL bulk) and ``ipc`` (same-host shared memory / CUDA IPC).
"""
