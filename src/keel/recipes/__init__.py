"""Recipes: the algorithm section of a config turned into an AlgorithmSpec the controller reads."""

from keel.algo.spec import AlgorithmSpec
from keel.recipes.builders import RECIPES, build_spec

__all__ = ["RECIPES", "AlgorithmSpec", "build_spec"]
