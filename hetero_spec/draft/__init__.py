"""Draft side: torch only, never llama_cpp."""
