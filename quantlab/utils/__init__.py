"""Small helpers shared across quantlab."""
