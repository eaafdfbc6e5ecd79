"""alspec-eval: accuracy evaluation of attention-level speculation (ALSpec, ICML 2025).

Importing the package stays light (no torch): the lm-eval registration hook imports it at
every interpreter start.
"""

from .approximations import Approximation, register_approximation
from .config import SpeculationConfig

__version__ = "0.1.0"
__all__ = ["Approximation", "SpeculationConfig", "__version__", "register_approximation"]
