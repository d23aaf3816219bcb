"""Generation engines: launching servers (SGLang, vLLM, transformers) and one HTTP client for all."""
