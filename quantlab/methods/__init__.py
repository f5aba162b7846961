"""Built-in methods, one module each: a config, a quantized Linear, and its registration."""
