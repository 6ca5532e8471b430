"""The scaffolding both engine services (drafter_svc, verifier_svc) share: the executor, the
wire conversions and errors, the common command line, and the tensor wire codec.
"""
