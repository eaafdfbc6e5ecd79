"""Which at most 2S keys A~ attends to (model_args ``approx=`` and ``approx_args=``): a registry of
approximations, each one small class (sink.py, local.py, quest.py, topk.py, snapkv.py), and kvpress's presses
(kvpress.py). Torch-free to import."""

from .base import Approximation, LayerInputs, Promise, Selected, Site, draw_inputs, selection
from .catalog import DEFAULT, name_of
from .registry import approximation_class, default_approximation, make_approximation, names, order, register_approximation

__all__ = ["DEFAULT", "Approximation", "LayerInputs", "Promise", "Selected", "Site", "approximation_class",
           "default_approximation", "draw_inputs", "make_approximation", "name_of", "names", "order",
           "register_approximation", "selection"]
