"""Target side: llama.cpp only, never torch."""
