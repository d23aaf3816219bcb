"""A tiny demo target model, trained locally on a synthetic arithmetic task with short reasoning.

It lets the whole pipeline (generation, drafter training, acceptance) run end to end on a CPU,
without downloading any model: ``task`` defines the problems and the expected response format,
``build_model`` trains the tiny Qwen3 target and caches it.
"""
