"""asyncfp8."""
