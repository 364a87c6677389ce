"""Converters: feature export from a GGUF target (llama.cpp) or an HF checkpoint, and GGUF quantization."""
