"""The model a run trains, and the tokenizer and presets that size it.

A Llama built from a transformers config (`llama`), and the tokenizer and presets that size it
(`build`). Nothing is loaded from a hub.
"""
