"""Recipes: the algorithm section of a config turned into an AlgorithmSpec the controller reads."""

from keel.recipes.spec import AlgorithmSpec, build_spec

__all__ = ["AlgorithmSpec", "build_spec"]
