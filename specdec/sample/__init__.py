"""Sampling: ``SamplingParams`` and the processed distributions, the rejection sampler, and the
benchmark-only fixed-acceptance verifier (with its torch-free label and check).
"""
