"""Pure speculative logic: arrays in, decisions out; imports neither llama_cpp nor torch."""
