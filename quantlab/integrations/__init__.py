"""Glue to the libraries quantlab plugs into: transformers, PEFT, optimum."""
