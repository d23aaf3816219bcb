"""DFlash drafter pipeline: prompts -> target responses -> loss-masked tokens -> drafter -> acceptance.

Modules depend one way: storage -> data -> engines/model -> training/evaluation -> status/report.
"""

__version__ = "0.1.0"
