"""Models in and out of other tools' formats: a local Hugging Face Qwen3 folder into a run (``convert.py``)."""
