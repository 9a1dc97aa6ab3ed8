"""Hugging Face interop: `afmoe` export and import of the model (`hf.py`) and the run's tokenizer as a
`transformers` fast tokenizer (`tokenizer.py`). Used by `trinity-train export-hf` / `import-hf`;
the model package knows nothing of it."""
