"""Imported as a module by transformers' image processing utilities; nothing is called."""
