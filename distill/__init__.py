"""The draft distillation tool (``minedraft distill``) and its data generators; not part of the
serving engine. It imports the engine (``specdec``); nothing in the engine or the services imports it.
"""
