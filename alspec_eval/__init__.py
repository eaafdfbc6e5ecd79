"""alspec-eval: accuracy evaluation of attention-level speculation (ALSpec, ICML 2025).

Importing the package stays light (no torch): the lm-eval registration hook imports it at
every interpreter start.
"""

from .config import SpeculationConfig

__version__ = "0.1.0"
__all__ = ["SpeculationConfig", "__version__"]
