"""Acceptance-length evaluation: the real speculative-decoding loop, its metrics and checks.

``runner`` runs the target model with a cache that can be rolled back (hybrid GDN layers
included), ``loop`` is the speculative-decoding loop and plain decoding, ``metrics`` turns loop
traces into the metrics JSON, ``lossless`` and ``parity`` are the two gates, ``simulated`` is
training's teacher-forced acceptance on held-out rows, ``prompts`` reads the prompt files, and
``serving`` measures the same exported drafter inside vLLM or SGLang (the engine parity gate).
"""
