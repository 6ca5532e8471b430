"""Models: spec -> local dir (aliases, GGUF, random presets), loading, the MineDraft draft format,
its HF export, and the torch-free memory footprints.
"""
