"""The file and kwargs layer, at the bottom of the house: safetensors files (read, write, the one
tensor hash, metadata) and scalar kwargs (typed parsers, the one enum coercer, JSON)."""
