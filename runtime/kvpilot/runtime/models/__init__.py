"""Model definitions over the layers/ building blocks."""
