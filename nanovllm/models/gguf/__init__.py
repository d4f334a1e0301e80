"""GGUF files, in one place: a file's metadata (config, tokenizer, tensor table) read once into the cache
(`metadata`), the transformers config it stands for (`config`), its weights as they are stored, memory-mapped
(`weights`), and `python -m nanovllm convert`, which writes it out as a float32 Hugging Face checkpoint (`convert`)."""
