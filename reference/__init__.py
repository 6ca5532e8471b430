"""The in-process reference loops ``ar`` / ``sd`` / ``psd`` (``reference.loop``) and their command
line (``python -m reference``): the engine workers driven by the coordinator's Batch Manager in
one process, to check the algorithm (not the overlap). Sits above both ``specdec`` and
``coordinator``; neither imports it.
"""
