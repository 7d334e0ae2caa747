"""The model a run trains: a Llama built from a transformers config (`llama`), and the
tokenizer and presets that size it (`build`). Nothing is loaded from a hub."""
